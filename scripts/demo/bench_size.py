"""Size the demo target before training it: training tokens/s, and decode step vs verify cost.

    OMP_NUM_THREADS=1 python scripts/demo/bench_size.py --hidden 384 --layers 6 --heads 6 --kv-heads 2

Prints, for one configuration: parameter counts, bf16 file size, training throughput
(forward+backward+AdamW on [batch, seq] windows, threads=1), and the time of one cached
single-token decode step vs one cached 16-token verify pass at a given context length, for
torch threads 1 and 2 (median over repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtspec.models import Qwen3Config, Qwen3Target


def make_config(a) -> Qwen3Config:
    return Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate or 3 * a.hidden,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=a.head_dim, rope_theta=1e6, max_position_embeddings=2048, tie_word_embeddings=a.tie)


@torch.no_grad()
def step_vs_verify(model: Qwen3Target, context: int, block: int, repeats: int) -> tuple[float, float]:
    cache = model.new_cache(1, 1024 if context + block <= 1024 else context + block)
    prompt = torch.randint(2, model.config.vocab_size, (1, context))
    model(prompt, 0, cache)
    one = torch.randint(2, model.config.vocab_size, (1, 1))
    many = torch.randint(2, model.config.vocab_size, (1, block))
    times = {1: [], block: []}
    for _ in range(repeats):
        for tokens in (one, many):
            cache.rollback(context)
            t = time.perf_counter()
            model(tokens, context, cache)
            times[tokens.shape[1]].append(time.perf_counter() - t)
    return statistics.median(times[1]), statistics.median(times[block])


def train_throughput(model: Qwen3Target, batch: int, seq: int, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(2, model.config.vocab_size, (batch, seq + 1))
    done = []
    for i in range(steps + 1):
        t = time.perf_counter()
        logits, _ = model(data[:, :-1], 0, None)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocators
            done.append(time.perf_counter() - t)
    return batch * seq / statistics.median(done)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=0, help="default 3 x hidden")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--tie", action="store_true")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--train-steps", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    torch.manual_seed(0)
    config = make_config(a)
    model = Qwen3Target(config)
    embed = config.vocab_size * config.hidden_size
    non_embed = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    stored = non_embed + embed * (1 if a.tie else 2)
    print(f"config {config}")
    print(f"non-embedding params {non_embed / 1e6:.2f}M, stored params {stored / 1e6:.2f}M "
          f"(bf16 file {stored * 2 / 1e6:.1f} MB; + drafter of 1/4 non-embedding = {(stored + non_embed / 4) * 2 / 1e6:.1f} MB)")
    torch.set_num_threads(1)
    if a.train_steps:
        model.train()
        print(f"train threads=1 batch {a.batch}x{a.seq}: {train_throughput(model, a.batch, a.seq, a.train_steps):.0f} tokens/s")
    model.eval()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        step, verify = step_vs_verify(model, a.context, a.block, a.repeats)
        print(f"threads={threads} context {a.context}: step[1,1] {step * 1e3:.2f} ms, "
              f"verify[1,{a.block}] {verify * 1e3:.2f} ms, ratio {verify / step:.2f}")


if __name__ == "__main__":
    main()
