#include "controller.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace trtspec {

namespace {

// The first index of the largest value (torch.argmax's tie rule); logits hold no NaN. Eight
// independent lanes keep their own maximum and where it first occurred, so the compiler turns the
// loop into vector compares and blends; the lanes are merged, then the tail is scanned.
int64_t argmax(const float* row, size_t n) {
    constexpr size_t lanes = 8;
    const size_t body = n - n % lanes;
    float top = row[0];
    int64_t index = 0;
    if (body > 0) {
        float best[lanes];
        int32_t at[lanes];
        for (size_t l = 0; l < lanes; ++l) {
            best[l] = row[l];
            at[l] = static_cast<int32_t>(l);
        }
        for (size_t i = lanes; i < body; i += lanes) {
            for (size_t l = 0; l < lanes; ++l) {
                const bool more = row[i + l] > best[l];
                best[l] = more ? row[i + l] : best[l];
                at[l] = more ? static_cast<int32_t>(i + l) : at[l];
            }
        }
        for (size_t l = 0; l < lanes; ++l) {
            if (best[l] > top || (best[l] == top && at[l] < index)) {
                top = best[l];
                index = at[l];
            }
        }
    }
    for (size_t i = std::max<size_t>(body, 1); i < n; ++i) {
        if (row[i] > top) {
            top = row[i];
            index = static_cast<int64_t>(i);
        }
    }
    return index;
}

}  // namespace

Controller::Controller(int64_t block_size, int64_t limit, std::vector<int64_t> stop_ids, int64_t mask_token_id,
                       int64_t grow_to)
    : block_size_(block_size), limit_(limit), grow_to_(grow_to), active_(block_size), stop_ids_(std::move(stop_ids)) {
    if (block_size_ < 1 || limit_ < 1) throw std::invalid_argument("block size and limit must be >= 1");
    if (grow_to_ != 0 && (block_size_ < 2 || grow_to_ <= block_size_))
        throw std::invalid_argument("a block grows from B >= 2 to a larger size");
    if (grow_to_ == 0) grow_to_ = block_size_;
    width_ = static_cast<size_t>(grow_to_);
    verify_block_.assign(width_, 0);
    draft_block_.assign(width_, mask_token_id);
    tokens_.assign(static_cast<size_t>(limit_), 0);
    histogram_.assign(width_, 0);
}

bool Controller::is_stop(int64_t token) const {
    return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

// Append one token; a stop id or the limit finishes the request (the stop id is kept).
void Controller::push(int64_t token) {
    tokens_[count_] = token;
    count_ += 1;
    if (is_stop(token))
        finish_ = Finish::stop;
    else if (count_ == limit_)
        finish_ = Finish::length;
}

void Controller::begin(int64_t token, int64_t start) {
    std::fill(histogram_.begin(), histogram_.end(), 0);
    count_ = accepted_ = cycles_ = grown_cycles_ = ceilings_ = drafts_ = 0;
    active_ = block_size_;
    narrow_ = INT64_MAX;
    finish_ = Finish::running;
    push(token);
    committed_ = 1;
    start_ = start;
    verify_block_[0] = draft_block_[0] = token;
}

void Controller::set_block_size(int64_t size) {
    if (size < 1 || static_cast<size_t>(size) > width_)
        throw std::invalid_argument("block size " + std::to_string(size) + " is outside 1.." + std::to_string(width_));
    block_size_ = grow_to_ = active_ = size;
}

void Controller::narrow(int64_t width) {
    if (width < 1 || width > active_)
        throw std::invalid_argument("width " + std::to_string(width) + " is outside 1.." + std::to_string(active_));
    narrow_ = width;
}

// Accept the longest prefix of the cycle's drafts that the target agrees with (draft k against the
// target's token for its position, posterior(k-1)), commit it and the bonus posterior(a), choose
// the next cycle's block size, move on.
template <typename Posterior>
void Controller::cycle(Posterior posterior) {
    const int64_t b = next_width(), base = block_size_;
    int64_t* block = verify_block_.data();
    int64_t a = 0, bonus = posterior(0);
    while (a < b - 1 && block[a + 1] == bonus) bonus = posterior(++a);
    histogram_[a] += 1;
    cycles_ += 1;
    drafts_ += b - 1;
    grown_cycles_ += active_ != base;
    ceilings_ += a == active_ - 1;
    narrow_ = INT64_MAX;
    active_ = a >= base - 1 ? grow_to_ : base;
    const int64_t before = count_;
    for (int64_t k = 1; k <= a + 1 && finish_ == Finish::running; ++k) push(k <= a ? block[k] : bonus);
    committed_ = count_ - before;
    accepted_ = a;
    start_ += a + 1;
    block[0] = draft_block_[0] = bonus;
}

bool Controller::step(const int64_t* posterior, size_t count, int64_t stride) {
    if (!running()) return false;
    if (count < static_cast<size_t>(next_width())) throw std::invalid_argument("the posterior is shorter than the cycle");
    cycle([&](int64_t k) { return posterior[k * stride]; });
    return running();
}

bool Controller::step_greedy(const float* logits, size_t rows, int64_t row_stride, size_t vocab) {
    if (!running()) return false;
    if (rows < static_cast<size_t>(next_width()))
        throw std::invalid_argument("the logits hold fewer positions than the cycle");
    cycle([&](int64_t k) { return argmax(logits + k * row_stride, vocab); });
    return running();
}

double Controller::tau() const {
    if (cycles_ == 0) return 0.0;
    int64_t tokens = 0;
    for (size_t a = 0; a < width_; ++a) tokens += static_cast<int64_t>(a + 1) * histogram_[a];
    return static_cast<double>(tokens) / static_cast<double>(cycles_);
}

double Controller::ceiling_fraction() const {
    if (cycles_ == 0) return 0.0;
    return static_cast<double>(ceilings_) / static_cast<double>(cycles_);
}

}  // namespace trtspec
