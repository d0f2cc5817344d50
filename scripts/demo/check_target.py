"""Check an exported demo target: it loads, it decodes plausible Python, and what it weighs.

    OMP_NUM_THREADS=1 python scripts/demo/check_target.py trtspec/assets/demo-target

Loads the directory with trtspec.models.load_target (bf16 file -> fp32), prints file sizes and
parameter counts, and greedy-decodes a few Python prompts through the eager engine (block size 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trtspec.models import load_target
from trtspec.runtime.engine import EngineConfig, EngineCore
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.schedule import AR
from trtspec.tokenizer import TextCodec

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(directory):\n    \"\"\"Return the .py files under directory.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path)
    p.add_argument("--max-new-tokens", type=int, default=80)
    a = p.parse_args()
    torch.set_num_threads(1)
    for f in sorted(a.directory.iterdir()):
        print(f"{f.name:28s} {f.stat().st_size / 1e6:8.2f} MB")
    print(f"{'total':28s} {sum(f.stat().st_size for f in a.directory.iterdir()) / 1e6:8.2f} MB")
    target = load_target(a.directory, dtype=torch.float32)
    c = target.config
    non_embed = sum(p.numel() for n, p in target.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    print(f"loaded {target.dtype}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
          f"non-embedding params {non_embed / 1e6:.2f}M, embedding {c.vocab_size * c.hidden_size / 1e6:.2f}M "
          f"(tied={c.tie_word_embeddings}); a drafter may have <= {non_embed / 4e6:.2f}M params")
    codec = TextCodec(a.directory)
    engine = EngineCore(BatchRunner.eager(target, None, 1), config=EngineConfig(max_running=1, prefill_chunk=0),
                        stop_ids=tuple(codec.stop_ids))
    for prompt in PROMPTS:
        out = engine.generate([codec.encode(prompt)], [GenerationConfig(block=AR, max_new_tokens=a.max_new_tokens)])[0]
        print("-" * 72)
        print(prompt + codec.decode(out.tokens))


if __name__ == "__main__":
    main()
