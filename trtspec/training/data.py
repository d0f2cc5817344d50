"""Training data: prompts in, the target's own continuations out (the recipe trains on
target-regenerated responses), and reading them back as token sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text
from trtspec.runtime.decode import GenerationConfig
from trtspec.runtime.sampling import Sampler


def read_jsonl(path: str | Path, required: tuple[str, ...]) -> list[dict]:
    """Records of a JSONL file, each an object holding the `required` keys."""
    source = Path(path)
    if not source.is_file():
        raise TrtspecError(f"file not found: {source}")
    records = []
    with source.open(encoding="utf-8") as lines:
        try:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TrtspecError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or any(key not in record for key in required):
                    raise TrtspecError(f"{source}:{number}: each line must be an object with {', '.join(required)}")
                records.append(record)
        except UnicodeDecodeError:
            raise TrtspecError(f"{source} is not valid UTF-8") from None
    if not records:
        raise TrtspecError(f"{source} holds no records")
    return records


def write_jsonl_atomic(records: list[dict], path: str | Path) -> Path:
    return atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))


def continue_prompts(target, prompts: list[list[int]], config: GenerationConfig, batch_size: int = 16,
                     progress: bool = True) -> list[list[int]]:
    """The target's own continuation of every prompt, decoded in batches of equal-length prompts.

    Data generation is throughput work, so prompts of the same token length share one batched
    autoregressive pass; each row is cut after its first stop id or at the token limit.
    """
    sampler = Sampler(config.sampling, target.device)
    stops = torch.tensor(sorted(set(config.stop_ids)) or [-1], device=target.device)
    by_length: dict[int, list[int]] = {}
    for index, ids in enumerate(prompts):
        if not ids:
            raise TrtspecError(f"prompt {index + 1} is empty")
        by_length.setdefault(len(ids), []).append(index)
    chunks = [members[i:i + batch_size] for members in by_length.values() for i in range(0, len(members), batch_size)]
    results: list[list[int]] = [[] for _ in prompts]
    bar = tqdm(total=len(prompts), desc="generate-data", unit="prompt", disable=not progress, dynamic_ncols=True)
    with torch.inference_mode():
        for chunk in chunks:
            length = len(prompts[chunk[0]])
            budget = min(config.max_new_tokens, target.config.max_position_embeddings - length)
            if budget < 1:
                raise TrtspecError(f"a prompt of {length} tokens leaves no room in the target's context")
            tokens = torch.tensor([prompts[i] for i in chunk], device=target.device)
            cache = target.new_cache(len(chunk), length + budget)
            logits, _ = target(tokens, 0, cache, last_logits=1)
            generated, finished = [], torch.zeros(len(chunk), dtype=torch.bool, device=target.device)
            for step in range(budget):
                token = sampler.sample(logits[:, -1])
                generated.append(token)
                finished |= torch.isin(token, stops)
                if bool(finished.all()) or step == budget - 1:
                    break
                logits, _ = target(token[:, None], length + step, cache)
            rows = torch.stack(generated, dim=1).tolist()
            for index, row in zip(chunk, rows):
                cut = next((k + 1 for k, t in enumerate(row) if t in config.stop_ids), len(row))
                results[index] = row[:cut]
            bar.update(len(chunk))
    bar.close()
    return results


def generate_data(pipeline, prompts: list[dict], config: GenerationConfig, output: str | Path,
                  batch_size: int = 16, progress: bool = True) -> Path:
    """Continue every prompt record ({"prompt"} and optionally its "prompt_ids") with the target
    alone; write {"prompt", "response", "prompt_ids", "response_ids"} lines."""
    config = config.with_stop_ids(pipeline.codec.stop_ids)
    prompt_ids = [r.get("prompt_ids") or pipeline.codec.encode(r["prompt"]) for r in prompts]
    responses = continue_prompts(pipeline.target, prompt_ids, config, batch_size, progress)
    records = [{"prompt": r["prompt"], "response": pipeline.codec.decode(out), "prompt_ids": ids,
                "response_ids": out} for r, ids, out in zip(prompts, prompt_ids, responses)]
    return write_jsonl_atomic(records, output)


def read_training_data(path: str | Path, codec) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per record; ids are used when present, text otherwise."""
    sequences = []
    for record in read_jsonl(path, ("prompt", "response")):
        prompt_ids = record.get("prompt_ids") or codec.encode(record["prompt"])
        response_ids = record.get("response_ids")
        if response_ids is None:
            response_ids = codec.tokenizer.encode(record["response"], add_special_tokens=False).ids
        sequences.append((list(prompt_ids) + list(response_ids), len(prompt_ids)))
    return sequences
