// The per-cycle host logic of speculative decoding for one request.
//
// After draft(B) and verify(B) have run, `step` decides how many drafts the target accepted,
// commits them and the bonus token into a preallocated token buffer (applying stop ids and the
// token limit, also mid-block), records the acceptance histogram, advances the position the KV
// caches roll back to, and writes the next block's bonus token in place. Every buffer is
// allocated once at construction; a step allocates nothing.
//
// A request may also grow its block: with a grown size G above its base size B, a cycle that
// accepts at least B-1 drafts (it filled a base block) makes the next cycle run at G, any other
// cycle makes the next one run at B. The choice depends only on committed tokens, so every cycle
// is still an exact speculative step and the output keeps the target's distribution.
//
// A cycle may also be narrowed: it verifies only its first W positions (the bonus and W-1 drafts),
// as when prompt lookup's copy is short and the drafter's later proposals are rarely accepted. The
// width is chosen from committed tokens (the copy) or, for a greedy request, from the drafter's own
// probabilities, never from the target's logits, so a narrowed cycle is an exact speculative step
// too; it counts as a ceiling only when it ran its whole block.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace trtspec {

enum class Finish : int64_t { running = 0, stop = 1, length = 2 };

class Controller {
public:
    // The request's block size (1 = autoregressive), token limit and stop ids; `grow_to`: its
    // grown block size (0: the block never grows).
    Controller(int64_t block_size, int64_t limit, std::vector<int64_t> stop_ids, int64_t mask_token_id,
               int64_t grow_to = 0);

    // Commit the prefill's token, whose position is `start`.
    void begin(int64_t token, int64_t start);

    // From the next cycle on, run blocks of `size` (1: autoregressive), never growing: what is
    // committed, the position and the statistics so far stay.
    void set_block_size(int64_t size);

    // The next cycle verifies only its first `width` positions (1..its block size); the one after
    // runs its whole block again unless narrowed too.
    void narrow(int64_t width);

    // One cycle from the posterior tokens of block positions 0..B-1 (`stride` apart); the drafts
    // are those in the verify block. Returns whether the request still runs.
    bool step(const int64_t* posterior, size_t count, int64_t stride);

    // The same with greedy posterior tokens: the argmax of each row of logits [rows, vocab]
    // (`row_stride` apart), computed only for the positions the acceptance rule reads.
    bool step_greedy(const float* logits, size_t rows, int64_t row_stride, size_t vocab);

    size_t width() const { return width_; }   // the largest block size: the length of the blocks
    size_t capacity() const { return static_cast<size_t>(limit_); }  // the length of tokens
    bool running() const { return finish_ == Finish::running; }

    int64_t block_size() const { return active_; }  // the next cycle's block size
    int64_t next_width() const { return std::min(active_, narrow_); }  // the positions the next cycle verifies
    int64_t drafts() const { return drafts_; }              // drafts verified, summed over cycles
    int64_t grown_cycles() const { return grown_cycles_; }  // cycles run at the grown size
    int64_t ceilings() const { return ceilings_; }          // cycles that accepted every draft
    int64_t count() const { return count_; }
    int64_t start() const { return start_; }
    int64_t accepted() const { return accepted_; }
    int64_t committed() const { return committed_; }
    Finish finish() const { return finish_; }
    int64_t cycles() const { return cycles_; }
    double tau() const;
    double ceiling_fraction() const;

    // Buffers shared with Python without copies.
    int64_t* verify_block() { return verify_block_.data(); }  // [width]: bonus, drafts
    int64_t* draft_block() { return draft_block_.data(); }    // [width]: bonus, MASK x (B-1)
    int64_t* tokens() { return tokens_.data(); }              // [capacity]: committed tokens
    int64_t* histogram() { return histogram_.data(); }        // [width]: cycles per accepted count

private:
    bool is_stop(int64_t token) const;
    void push(int64_t token);
    template <typename Posterior>
    void cycle(Posterior posterior);

    int64_t block_size_, limit_, grow_to_, active_;
    int64_t narrow_ = INT64_MAX;  // the next cycle's width when narrowed (INT64_MAX: its whole block)
    std::vector<int64_t> stop_ids_;
    size_t width_ = 1;
    std::vector<int64_t> verify_block_, draft_block_, tokens_, histogram_;
    int64_t count_ = 0, start_ = 0, accepted_ = 0, committed_ = 0, cycles_ = 0, grown_cycles_ = 0, ceilings_ = 0, drafts_ = 0;
    Finish finish_ = Finish::length;  // not begun: nothing to run
};

}  // namespace trtspec
