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

Controller::Controller(std::vector<int64_t> block_sizes, std::vector<int64_t> limits,
                       const std::vector<std::vector<int64_t>>& stop_ids, int64_t mask_token_id,
                       std::vector<int64_t> grow_to)
    : block_sizes_(std::move(block_sizes)), limits_(std::move(limits)), grow_to_(std::move(grow_to)) {
    const size_t n = block_sizes_.size();
    if (grow_to_.empty()) grow_to_.assign(n, 0);
    if (n == 0 || limits_.size() != n || stop_ids.size() != n || grow_to_.size() != n)
        throw std::invalid_argument("one block size, limit and stop-id list per request, at least one request");
    for (size_t r = 0; r < n; ++r) {
        if (block_sizes_[r] < 1 || limits_[r] < 1)
            throw std::invalid_argument("request " + std::to_string(r) + ": block size and limit must be >= 1");
        if (grow_to_[r] != 0 && (block_sizes_[r] < 2 || grow_to_[r] <= block_sizes_[r]))
            throw std::invalid_argument("request " + std::to_string(r) + ": a block grows from B >= 2 to a larger size");
        if (grow_to_[r] == 0) grow_to_[r] = block_sizes_[r];
        width_ = std::max(width_, static_cast<size_t>(grow_to_[r]));
        capacity_ = std::max(capacity_, static_cast<size_t>(limits_[r]));
    }
    stop_offsets_.push_back(0);
    for (const auto& ids : stop_ids) {
        stop_ids_.insert(stop_ids_.end(), ids.begin(), ids.end());
        stop_offsets_.push_back(static_cast<int64_t>(stop_ids_.size()));
    }
    verify_blocks_.assign(n * width_, 0);
    draft_blocks_.assign(n * width_, mask_token_id);
    tokens_.assign(n * capacity_, 0);
    histograms_.assign(n * width_, 0);
    counts_.assign(n, 0);
    starts_.assign(n, 0);
    accepted_.assign(n, 0);
    committed_.assign(n, 0);
    finish_.assign(n, static_cast<int64_t>(Finish::length));  // not begun: nothing to run
    cycles_.assign(n, 0);
    grown_cycles_.assign(n, 0);
    ceilings_.assign(n, 0);
    active_ = block_sizes_;
}

bool Controller::is_stop(size_t r, int64_t token) const {
    const auto first = stop_ids_.begin() + stop_offsets_[r], last = stop_ids_.begin() + stop_offsets_[r + 1];
    return std::find(first, last, token) != last;
}

// Append one token; a stop id or the limit finishes the request (the stop id is kept).
void Controller::push(size_t r, int64_t token) {
    tokens_[r * capacity_ + counts_[r]] = token;
    counts_[r] += 1;
    if (is_stop(r, token))
        finish_[r] = static_cast<int64_t>(Finish::stop);
    else if (counts_[r] == limits_[r])
        finish_[r] = static_cast<int64_t>(Finish::length);
}

void Controller::begin(size_t r, int64_t token, int64_t start) {
    if (r >= requests()) throw std::out_of_range("no request " + std::to_string(r));
    std::fill_n(histograms_.begin() + r * width_, width_, 0);
    counts_[r] = accepted_[r] = cycles_[r] = grown_cycles_[r] = ceilings_[r] = 0;
    active_[r] = block_sizes_[r];
    finish_[r] = static_cast<int64_t>(Finish::running);
    push(r, token);
    committed_[r] = 1;
    starts_[r] = start;
    verify_blocks_[r * width_] = draft_blocks_[r * width_] = token;
}

void Controller::set_block_size(size_t r, int64_t size) {
    if (r >= requests()) throw std::out_of_range("no request " + std::to_string(r));
    if (size < 1 || static_cast<size_t>(size) > width_)
        throw std::invalid_argument("block size " + std::to_string(size) + " is outside 1.." + std::to_string(width_));
    block_sizes_[r] = grow_to_[r] = active_[r] = size;
}

// Accept the longest prefix of drafts that the target agrees with (draft k against the target's
// token for its position, posterior(k-1)), commit it and the bonus posterior(a), choose the next
// cycle's block size, move on.
template <typename Posterior>
void Controller::cycle(size_t r, Posterior posterior) {
    const int64_t b = active_[r], base = block_sizes_[r];
    int64_t* block = &verify_blocks_[r * width_];
    int64_t a = 0, bonus = posterior(0);
    while (a < b - 1 && block[a + 1] == bonus) bonus = posterior(++a);
    histograms_[r * width_ + a] += 1;
    cycles_[r] += 1;
    grown_cycles_[r] += b != base;
    ceilings_[r] += a == b - 1;
    active_[r] = a >= base - 1 ? grow_to_[r] : base;
    const int64_t before = counts_[r];
    for (int64_t k = 1; k <= a + 1 && finish_[r] == static_cast<int64_t>(Finish::running); ++k)
        push(r, k <= a ? block[k] : bonus);
    committed_[r] = counts_[r] - before;
    accepted_[r] = a;
    starts_[r] += a + 1;
    block[0] = draft_blocks_[r * width_] = bonus;
}

size_t Controller::step(const Rows<int64_t>& posterior) {
    if (posterior.rows != requests())
        throw std::invalid_argument("posterior has " + std::to_string(posterior.rows) + " rows for " +
                                    std::to_string(requests()) + " requests");
    for (size_t r = 0; r < requests(); ++r) {
        if (finish_[r] != static_cast<int64_t>(Finish::running)) continue;
        if (posterior.cols < static_cast<size_t>(active_[r]))
            throw std::invalid_argument("posterior row " + std::to_string(r) + " is shorter than its block");
        cycle(r, [&](int64_t k) { return posterior.at(r, static_cast<size_t>(k)); });
    }
    return running();
}

size_t Controller::step_greedy(const float* logits, size_t block_stride, int64_t row_stride, size_t vocab) {
    for (size_t r = 0; r < requests(); ++r) {
        if (finish_[r] != static_cast<int64_t>(Finish::running)) continue;
        const float* rows = logits + r * block_stride;
        cycle(r, [&](int64_t k) { return argmax(rows + k * row_stride, vocab); });
    }
    return running();
}

size_t Controller::running() const {
    return static_cast<size_t>(std::count(finish_.begin(), finish_.end(), static_cast<int64_t>(Finish::running)));
}

double Controller::tau(size_t r) const {
    if (cycles_.at(r) == 0) return 0.0;
    int64_t tokens = 0;
    for (size_t a = 0; a < width_; ++a) tokens += static_cast<int64_t>(a + 1) * histograms_[r * width_ + a];
    return static_cast<double>(tokens) / static_cast<double>(cycles_[r]);
}

double Controller::ceiling_fraction(size_t r) const {
    if (cycles_.at(r) == 0) return 0.0;
    return static_cast<double>(ceilings_[r]) / static_cast<double>(cycles_[r]);
}

}  // namespace trtspec
