"""Copy a trained drafter into the package's bundled assets with bfloat16 weights (half the size).

    python scripts/demo/ship_drafter.py build/demo/demo-b24 trtspec/assets/demo-b24
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trtspec.models.checkpoint import save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("destination")
    args = parser.parse_args()
    source = Path(args.source)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config["torch_dtype"] = "bfloat16"
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(source / "model.safetensors")).items()}
    print(save_checkpoint(args.destination, config, tensors))


if __name__ == "__main__":
    main()
