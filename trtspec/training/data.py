"""Training data: prompts in, the target's own continuations out (the recipe trains on
target-regenerated responses), and reading them back as token sequences."""

from __future__ import annotations

import json
from pathlib import Path

from dataclasses import replace

from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text
from trtspec.limits import LIMIT
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import derive_seed
from trtspec.runtime.schedule import AR
from trtspec.validate import Fields, check_token_range, jsonl_records, prompt_record


def read_jsonl(path: str | Path, required: tuple[str, ...]) -> list[dict]:
    """Records of a JSONL file, each an object holding the `required` keys."""
    return [record for _, record in jsonl_records(path, required)]


def read_prompt_set(path: str | Path, limit: int | None = None, response: bool = False) -> list[dict]:
    """The first `limit` records of a JSONL prompt set, each checked field by field: "prompt" (and
    optional "prompt_ids"); with `response`, also "response" (and optional "response_ids")."""
    if limit is not None:
        LIMIT.check(limit, "--limit")
    required = ("prompt", "response") if response else ("prompt",)
    return [prompt_record(Fields(record, where), response)
            for where, record in jsonl_records(path, required)[:limit]]


def write_jsonl_atomic(records: list[dict], path: str | Path) -> Path:
    return atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))


def continue_prompts(pipeline, prompts: list[list[int]], config: GenerationConfig, batch_size: int = 16,
                     progress: bool = True) -> list[list[int]]:
    """The target's own continuation of every prompt (autoregressive), `batch_size` decoded together
    by the engine; request i samples with seed derive_seed(seed, i), so a prompt's continuation
    does not depend on which others share its batch. Each ends after a stop id or at the limit."""
    for index, ids in enumerate(prompts):
        if not ids:
            raise TrtspecError(f"prompt {index + 1} is empty")
    engine = pipeline.autoregressive().stepped_engine(EngineConfig(max_running=batch_size), load_aware=False)
    configs = [replace(config, block=AR, sampling=replace(config.sampling, seed=derive_seed(config.sampling.seed, i)))
               for i in range(len(prompts))]
    with tqdm(total=len(prompts), desc="generate-data", unit="prompt", disable=not progress,
              dynamic_ncols=True) as bar:
        generations = engine.generate(prompts, configs, on_finish=lambda _: bar.update())
    return [generation.tokens for generation in generations]


def generate_data(pipeline, prompts: list[dict], config: GenerationConfig, output: str | Path,
                  batch_size: int = 16, progress: bool = True) -> Path:
    """Continue every prompt record ({"prompt"} and optionally its "prompt_ids") with the target
    alone; write {"prompt", "response", "prompt_ids", "response_ids"} lines."""
    config = config.with_stop_ids(pipeline.codec.stop_ids)
    prompt_ids = [r.get("prompt_ids") or pipeline.codec.encode(r["prompt"]) for r in prompts]
    for number, ids in enumerate(prompt_ids, 1):
        check_token_range(f"prompt {number}", "prompt_ids", ids, pipeline.vocab_size)
    responses = continue_prompts(pipeline, prompt_ids, config, batch_size, progress)
    records = [{"prompt": r["prompt"], "response": pipeline.codec.decode(out), "prompt_ids": ids,
                "response_ids": out} for r, ids, out in zip(prompts, prompt_ids, responses)]
    return write_jsonl_atomic(records, output)


def read_training_data(path: str | Path, codec, vocab_size: int | None = None) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per record; ids are used when present (and must index a
    vocabulary of `vocab_size`), text otherwise."""
    sequences = []
    for number, record in enumerate(read_prompt_set(path, response=True), 1):
        prompt_ids = record["prompt_ids"] or codec.encode(record["prompt"])
        response_ids = record["response_ids"]
        if response_ids is None:
            response_ids = codec.tokenizer.encode(record["response"], add_special_tokens=False).ids
        elif vocab_size is not None:
            check_token_range(f"{path} record {number}", "response_ids", response_ids, vocab_size)
        if record["prompt_ids"] and vocab_size is not None:
            check_token_range(f"{path} record {number}", "prompt_ids", prompt_ids, vocab_size)
        sequences.append((list(prompt_ids) + list(response_ids), len(prompt_ids)))
    return sequences
