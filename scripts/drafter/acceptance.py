"""Expected acceptance of drafters along the target's own continuations: tau without decoding's noise.

The target writes each prompt's continuation once (autoregressive through the backend the product's
commands choose, as `generate-data` writes them). Then, teacher forced, one target pass gives its
distribution p after every position and one packed drafter pass gives q for a block anchored at every
response position. Block position k's draft is accepted, once the drafts before it were, with
probability: at T = 0, 1 when the drafter's argmax is the target's (exact: the continuation is what
decoding verifies against); at T > 0, drafts drawn from q at --proposal-temperature x T and verified by
speculative sampling, sum_v min(p_v, q_v) (the earlier positions then hold the target's own draws where
decoding holds accepted drafts: close, not identical). A block's expected tau is 1 + the sum of the
running products; the figure is the mean over blocks (whole blocks: no prompt-lookup copies, which
decoding adds). A sampled request's tau in `trtspec bench` varies by +-0.05 between seeds on 40
prompts; this figure moves only with the drafter, so two drafters compare on a few dozen prompts.
`--tree-sizes` adds what the same drafts would give verified as a tree rather than a chain (tree_taus);
`--ceiling` what any block drafter could reach at T > 0 (marginal_ceiling).

    python scripts/drafter/acceptance.py --chat --limit 40 --temperature 1 --drafters smollm2-b16,build/new-drafter
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

import torch

from trtspec.api import Pipeline
from trtspec.fileio import atomic_write_text
from trtspec.perf.bench import add_script_options, load_prompts, script_pipeline
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import DEFAULT_PROPOSAL_TEMPERATURE, SamplingConfig
from trtspec.training.blocks import pack
from trtspec.training.data import continue_prompts

BLOCKS = (4, 8, 16)


def continuations(args) -> list[tuple[list[int], int]]:
    """(prompt + continuation ids, prompt length) of each prompt, written by the target alone."""
    pipeline = script_pipeline(args, 1)
    _, prompts = load_prompts(args.prompts, args.limit)
    ids = [pipeline.codec.encode(prompt, chat=args.chat) for prompt in prompts]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens,
                              sampling=SamplingConfig(temperature=args.temperature, seed=args.seed))
    written = continue_prompts(pipeline, ids, config.with_stop_ids(pipeline.codec.stop_ids), progress=False)
    return [(prompt + out, len(prompt)) for prompt, out in zip(ids, written)]


@torch.no_grad()
def teacher_forced(pipeline: Pipeline, ids: list[int], prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a block anchored at each response position with a whole block after it (prompt_length + i):
    the target's logits [A, B-1, V] before each of its drafts and the drafter's proposal logits
    [A, B-1, K] there."""
    target, drafter = pipeline.target, pipeline.drafter
    size = drafter.config.block_size
    logits, features = target(torch.tensor([ids]), 0, None, drafter.config.target_layer_ids)
    anchors = torch.arange(prompt_length, len(ids) - size + 1)
    batch = pack([(ids, prompt_length)], size, 0, drafter.config.mask_token_id, 1.0, None, anchor_sets=[anchors])
    drafted = drafter.forward_packed(features, batch.block_tokens, batch.block_positions, batch.mask)
    before = batch.block_positions[0].view(len(anchors), size)[:, 1:] - 1  # the position each draft follows
    return (logits[0].float()[before],
            drafter.proposal_logits(drafted[0]).float().view(len(anchors), size, -1)[:, 1:])


def block_acceptance(pipeline: Pipeline, forced: tuple[torch.Tensor, torch.Tensor], temperature: float,
                     proposal_temperature: float) -> torch.Tensor:
    """[A, B-1]: the chance each draft of each block is accepted once those before it were (at T = 0:
    1 or 0), from `teacher_forced`'s logits."""
    target_logits, draft_logits = forced
    if temperature == 0:
        proposed = draft_logits.argmax(-1)
        if pipeline.draft_ids is not None:
            proposed = pipeline.draft_ids[proposed]
        return (proposed == target_logits.argmax(-1)).float()
    return torch.minimum(*distributions(pipeline, forced, temperature, proposal_temperature)).sum(-1)


def distributions(pipeline: Pipeline, forced: tuple[torch.Tensor, torch.Tensor], temperature: float,
                  proposal_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """From `teacher_forced`'s logits: the target's distributions (one-hot at T = 0) over the
    drafter's vocabulary (q is zero off it) and the drafter's proposal distributions (at T = 0 its
    own softmax, which ranks a tree's drafts)."""
    target_logits, draft_logits = forced
    if temperature == 0:
        p = torch.zeros_like(target_logits).scatter_(-1, target_logits.argmax(-1, keepdim=True), 1.0)
        q = draft_logits.softmax(-1)
    else:
        p = (target_logits / temperature).softmax(-1)
        q = (draft_logits / (proposal_temperature * temperature)).softmax(-1)
    return (p[..., pipeline.draft_ids] if pipeline.draft_ids is not None else p), q


def tree_taus(target_probs: torch.Tensor, draft_probs: torch.Tensor, sizes: list[int], top: int = 8) -> torch.Tensor:
    """[A, len(sizes)]: each block's expected tau with a draft tree of each size (nodes besides the
    bonus token) instead of a chain. A block drafter's positions are independent, so the tree grows
    best-first by the product of the drafts' proposal probabilities along a path (each node's
    children: its position's `top` most probable drafts). It is verified by sampling the target at
    each node and descending where the sample is a child (lossless as it stands: the target draws
    every token), so a node is reached with the product of the target's probabilities along its path.
    Teacher forced, that product takes each position's target distribution along the continuation:
    exact at T = 0 (one-hot `target_probs`: a node counts when its path is the continuation), at
    T > 0 an estimate (off the continuation the target's later distributions differ)."""
    depth = draft_probs.shape[1]
    ranked, ids = draft_probs.topk(min(top, draft_probs.shape[-1]), -1)  # [A, D, top]
    reached = target_probs.gather(-1, ids)
    out = torch.ones(len(draft_probs), len(sizes), dtype=torch.float64)
    for a, (q, p) in enumerate(zip(ranked.tolist(), reached.tolist())):
        frontier = [(-q[0][r], p[0][r], (r,)) for r in range(len(q[0]))]
        heapq.heapify(frontier)
        total, grown = 1.0, 0
        for column, size in enumerate(sizes):
            while grown < size and frontier:
                minus_q, value, path = heapq.heappop(frontier)
                total, grown = total + value, grown + 1
                if len(path) < depth:
                    for r in range(len(q[len(path)])):
                        heapq.heappush(frontier, (minus_q * q[len(path)][r], value * p[len(path)][r], path + (r,)))
            out[a, column] = total
    return out


def acceptance(pipeline: Pipeline, sequences: list[tuple[list[int], int]], temperature: float,
               proposal_temperatures: list[float], tree_sizes: tuple[int, ...] = ()) -> dict:
    """Mean expected tau at each block size up to the drafter's and the mean acceptance of block
    positions 1..8, per proposal temperature (T = 0: greedy drafts only)."""
    size = pipeline.drafter.config.block_size
    blocks = [b for b in BLOCKS if b <= size]
    rules = proposal_temperatures if temperature > 0 else [0.0]
    taus = {rule: {b: 0.0 for b in blocks} for rule in rules}
    positions = {rule: torch.zeros(size - 1, dtype=torch.float64) for rule in rules}
    trees = {rule: torch.zeros(len(tree_sizes), dtype=torch.float64) for rule in rules}
    count = 0
    for ids, prompt_length in sequences:
        if len(ids) - size < prompt_length:
            continue  # no whole block in the response
        forced = teacher_forced(pipeline, ids, prompt_length)
        for rule in rules:
            overlap = block_acceptance(pipeline, forced, temperature, rule)
            chain = overlap.cumprod(1)
            positions[rule] += overlap.sum(0).double()
            for b in blocks:
                taus[rule][b] += float((1 + chain[:, :b - 1].sum(1)).sum())
            if tree_sizes:
                trees[rule] += tree_taus(*distributions(pipeline, forced, temperature, rule), tree_sizes).sum(0)
        count += len(overlap)
    if not count:
        raise SystemExit(f"no continuation is longer than a block of {size}: raise --max-new-tokens")
    return {"blocks": count, "rules": [
        {"proposal_temperature": rule if temperature else None,
         "tau": {str(b): round(v / count, 4) for b, v in taus[rule].items()},
         "tree_tau": {str(n): round(float(v) / count, 4) for n, v in zip(tree_sizes, trees[rule])},
         "position_acceptance": [round(float(x), 4) for x in (positions[rule] / count)[:8]]} for rule in rules]}


def _cache_rows(target, prefix, rows: int, room: int):
    """A cache of `rows` copies of `prefix`'s keys and values, with `room` positions after them."""
    cache = target.new_cache(rows, prefix.length + room)
    cache.k[:, :, :, :prefix.length] = prefix.k[:, :, :, :prefix.length]
    cache.v[:, :, :, :prefix.length] = prefix.v[:, :, :, :prefix.length]
    cache.length = prefix.length
    return cache


@torch.no_grad()
def marginal_ceiling(target, ids: list[int], size: int, temperature: float, rules: list[float], paths: int,
                     draws: int, generator: torch.Generator) -> dict[float, torch.Tensor]:
    """The best a drafter that draws its block positions independently of one another (a block
    drafter such as DFlash) can do at T > 0, for the block anchored at the last token of `ids`: drafts
    drawn from the target's own marginal of each position (estimated from `paths` sampled
    continuations, each position's distribution averaged over them), sharpened to each of `rules` x T
    (0: their argmax), verified by speculative sampling. -> {rule: expected accepted drafts [B-1]
    (cumulative products averaged over `draws` drafted blocks)}."""
    prefix = target.new_cache(1, len(ids))
    logits, _ = target(torch.tensor([ids]), 0, prefix, last_logits=1)
    first = (logits[0, -1].float() / temperature).softmax(-1)
    cache, steps = _cache_rows(target, prefix, paths, size), [first.expand(paths, -1)]
    token = torch.multinomial(steps[-1], 1, generator=generator)
    for k in range(size - 2):  # each path's next distribution given its own draws
        logits, _ = target(token, len(ids) + k, cache)
        steps.append((logits[:, -1].float() / temperature).softmax(-1))
        token = torch.multinomial(steps[-1], 1, generator=generator)
    marginal = torch.stack([step.mean(0) for step in steps])  # [B-1, V]
    out = {}
    for rule in rules:
        if rule == 0:
            q = torch.zeros_like(marginal).scatter_(1, marginal.argmax(1, keepdim=True), 1.0)
        else:
            q = (marginal.clamp_min(1e-30).log() / rule).softmax(-1)
        drafts = torch.stack([torch.multinomial(q[k], draws, replacement=True, generator=generator)
                              for k in range(size - 1)], 1)  # [draws, B-1]
        logits, _ = target(drafts[:, :-1], len(ids), _cache_rows(target, prefix, draws, size))
        p = torch.cat([first.expand(draws, 1, -1), (logits.float() / temperature).softmax(-1)], 1)
        p_drafts = p.gather(2, drafts[..., None])[..., 0]
        q_drafts = q.gather(1, drafts.T).T
        out[rule] = (p_drafts / q_drafts).clamp(max=1.0).cumprod(1).mean(0)
    return out


def ceiling(args, sequences: list[tuple[list[int], int]], rules: list[float]) -> dict:
    """marginal_ceiling's expected tau at every --ceiling-stride-th response position of each
    continuation, averaged."""
    target = Pipeline(None, None, dtype="float32", device="cpu").target
    generator = torch.Generator().manual_seed(args.seed)
    sums, count = {rule: torch.zeros(BLOCKS[-1] - 1, dtype=torch.float64) for rule in rules}, 0
    for ids, prompt_length in sequences:
        for anchor in range(prompt_length, len(ids) - BLOCKS[-1] + 1, args.ceiling_stride):
            chains = marginal_ceiling(target, ids[:anchor + 1], BLOCKS[-1], args.temperature, rules,
                                      args.ceiling_paths, args.ceiling_draws, generator)
            for rule, chain in chains.items():
                sums[rule] += chain.double()
            count += 1
    return {"anchors": count, "paths": args.ceiling_paths, "draws": args.ceiling_draws, "rules": [
        {"proposal_temperature": rule, "tau": {str(b): round(1 + float(sums[rule][:b - 1].sum()) / count, 4)
                                               for b in BLOCKS}} for rule in rules]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="smollm2-b16", help="Comma-separated drafter directories or names.")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--chat", action="store_true", help="Prompts in the target's chat template.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0,
                        help="Continuations sampled from this seed (each prompt its own, as generate-data's).")
    parser.add_argument("--proposal-temperatures", default=str(DEFAULT_PROPOSAL_TEMPERATURE),
                        help="At T > 0: drafts drawn at these fractions of T (comma-separated).")
    parser.add_argument("--ceiling", action="store_true",
                        help="At T > 0, also the ceiling of any drafter that draws its block positions independently "
                             "(drafts from the target's own per-position marginals; slow: ~10 s an anchor).")
    parser.add_argument("--ceiling-stride", type=int, default=20,
                        help="Every N-th response position anchors a ceiling block.")
    parser.add_argument("--ceiling-paths", type=int, default=48, help="Sampled continuations behind each marginal.")
    parser.add_argument("--ceiling-draws", type=int, default=32, help="Drafted blocks verified per anchor and rule.")
    parser.add_argument("--tree-sizes", default="",
                        help="Also the expected tau of draft trees of these sizes (comma-separated node counts, "
                             "e.g. 3,7,15,31, the drafts of chains of B = 4, 8, 16, 32; exact at T = 0, an "
                             "estimate at T > 0: tree_taus).")
    add_script_options(parser, "the figures")
    args = parser.parse_args()
    began = time.perf_counter()
    sequences = continuations(args)
    report = {"prompts": args.prompts, "limit": args.limit, "chat": args.chat, "temperature": args.temperature,
              "max_new_tokens": args.max_new_tokens, "seconds_generating": round(time.perf_counter() - began, 1),
              "drafters": []}
    rules = [float(x) for x in args.proposal_temperatures.split(",")]
    for name in args.drafters.split(","):
        pipeline = Pipeline(None, name, dtype="float32", device="cpu")
        figures = acceptance(pipeline, sequences, args.temperature, rules,
                             tuple(int(x) for x in args.tree_sizes.split(",") if x))
        report["drafters"].append({"drafter": name, **figures})
        for rule in figures["rules"]:
            drawn = f" drawn at {rule['proposal_temperature']} x T" if args.temperature else ""
            taus = ", ".join(f"B={b} {t:.3f}" for b, t in rule["tau"].items())
            firsts = " ".join(f"{a:.3f}" for a in rule["position_acceptance"][:4])
            print(f"{name}{drawn}: expected tau {taus} | positions 1-4 accepted {firsts}", flush=True)
            if rule["tree_tau"]:
                trees = ", ".join(f"{n} nodes {t:.3f}" for n, t in rule["tree_tau"].items())
                print(f"{name}{drawn}: draft trees, expected tau {trees}", flush=True)
    if args.ceiling and args.temperature > 0:
        report["ceiling"] = ceiling(args, sequences, [0.0] + rules)
        for rule in report["ceiling"]["rules"]:
            drawn = f"drawn at {rule['proposal_temperature']} x T" if rule["proposal_temperature"] else "their argmax"
            taus = ", ".join(f"B={b} {t:.3f}" for b, t in rule["tau"].items())
            print(f"ceiling, drafts from the target's own marginals, {drawn}: expected tau {taus}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
