// The per-cycle host logic of speculative decoding for a batch of requests.
//
// After draft(B) and verify(B) have run, one `step` decides, per request, how many drafts the
// target accepted, commits them and the bonus token into a preallocated token buffer (applying
// stop ids and the token limit, also mid-block), records the acceptance histogram, advances the
// position the KV caches roll back to, and writes the next block's bonus token in place. Every
// buffer is allocated once at construction; a step allocates nothing.
//
// A request may also grow its block: with a grown size G above its base size B, a cycle that
// accepts at least B-1 drafts (it filled a base block) makes the next cycle run at G, any other
// cycle makes the next one run at B. The choice depends only on committed tokens, so every cycle
// is still an exact speculative step and the output keeps the target's distribution.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace trtspec {

enum class Finish : int64_t { running = 0, stop = 1, length = 2 };

// A read-only 2-D view over int64 or float32 data with element strides (numpy, torch, DLPack).
template <typename T>
struct Rows {
    const T* data;
    size_t rows, cols;
    int64_t row_stride, col_stride;
    const T& at(size_t r, size_t k) const { return data[r * row_stride + k * col_stride]; }
};

class Controller {
public:
    // One entry per request: its block size (1 = autoregressive), its token limit and stop ids;
    // `grow_to`, if not empty, one grown block size per request (0: the block never grows).
    Controller(std::vector<int64_t> block_sizes, std::vector<int64_t> limits,
               const std::vector<std::vector<int64_t>>& stop_ids, int64_t mask_token_id,
               std::vector<int64_t> grow_to = {});

    // Commit the prefill's token for request r, whose position is `start`.
    void begin(size_t r, int64_t token, int64_t start);

    // From the next cycle on, request r runs blocks of `size` (1: autoregressive), never growing:
    // what it has committed, its position and its statistics so far stay.
    void set_block_size(size_t r, int64_t size);

    // One cycle for every running request from its posterior tokens (row r: block positions
    // 0..B-1). The drafts are those in the verify block. Returns how many requests still run.
    size_t step(const Rows<int64_t>& posterior);

    // The same with greedy posterior tokens: the argmax of each row of request r's logits
    // (`logits[r]` is [B, V]), computed only for the positions the acceptance rule reads.
    size_t step_greedy(const float* logits, size_t block_stride, int64_t row_stride, size_t vocab);

    size_t requests() const { return block_sizes_.size(); }
    size_t width() const { return width_; }        // the largest block size: the row length of blocks
    size_t capacity() const { return capacity_; }  // the largest limit: the row length of tokens
    size_t running() const;

    int64_t block_size(size_t r) const { return active_.at(r); }  // the next cycle's block size
    int64_t base_block_size(size_t r) const { return block_sizes_.at(r); }
    int64_t grow_to(size_t r) const { return grow_to_.at(r); }
    int64_t grown_cycles(size_t r) const { return grown_cycles_.at(r); }  // cycles run at the grown size
    int64_t ceilings(size_t r) const { return ceilings_.at(r); }          // cycles that accepted every draft
    int64_t count(size_t r) const { return counts_.at(r); }
    int64_t start(size_t r) const { return starts_.at(r); }
    int64_t accepted(size_t r) const { return accepted_.at(r); }
    int64_t committed(size_t r) const { return committed_.at(r); }
    Finish finish(size_t r) const { return static_cast<Finish>(finish_.at(r)); }
    int64_t cycles(size_t r) const { return cycles_.at(r); }
    double tau(size_t r) const;
    double ceiling_fraction(size_t r) const;

    // Row-major buffers shared with Python without copies.
    int64_t* verify_blocks() { return verify_blocks_.data(); }  // [R, width]: bonus, drafts
    int64_t* draft_blocks() { return draft_blocks_.data(); }    // [R, width]: bonus, MASK x (B-1)
    int64_t* tokens() { return tokens_.data(); }                // [R, capacity]: committed tokens
    int64_t* histograms() { return histograms_.data(); }        // [R, width]: cycles per accepted count

private:
    bool is_stop(size_t r, int64_t token) const;
    void push(size_t r, int64_t token);
    template <typename Posterior>
    void cycle(size_t r, Posterior posterior);

    std::vector<int64_t> block_sizes_, limits_, grow_to_, active_, stop_offsets_, stop_ids_;
    size_t width_ = 1, capacity_ = 1;
    std::vector<int64_t> verify_blocks_, draft_blocks_, tokens_, histograms_;
    std::vector<int64_t> counts_, starts_, accepted_, committed_, finish_, cycles_, grown_cycles_, ceilings_;
};

}  // namespace trtspec
