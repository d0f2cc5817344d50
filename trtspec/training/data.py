"""Training data: prompts in, the target's own continuations out (the recipe trains on
target-regenerated responses), and reading them back as token sequences."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.runtime.decode import GenerationConfig


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
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    with temporary.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    os.replace(temporary, target)
    return target


def generate_data(pipeline, prompts: list[str], config: GenerationConfig, output: str | Path,
                  progress: bool = True) -> Path:
    """Continue every prompt with the target alone and write {"prompt", "response", *_ids} lines."""
    records = []
    for prompt in tqdm(prompts, desc="generate-data", unit="prompt", disable=not progress, dynamic_ncols=True):
        prompt_ids = pipeline.codec.encode(prompt)
        result = pipeline.generate(prompt, config)
        records.append({"prompt": prompt, "response": result.text,
                        "prompt_ids": prompt_ids, "response_ids": result.tokens})
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
