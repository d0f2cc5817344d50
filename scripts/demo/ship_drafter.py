"""Copy a trained drafter into the package's bundled assets with bfloat16 weights (half the size).

    python scripts/demo/ship_drafter.py build/demo/demo-b24 trtspec/assets/demo-b24
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trtspec.models.checkpoint import load_state_dict, read_json, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("destination")
    args = parser.parse_args()
    source = Path(args.source)
    config = read_json(source / "config.json", "drafter")
    config["torch_dtype"] = "bfloat16"
    tensors = {name: t.to(torch.bfloat16) for name, t in load_state_dict(source, "drafter").items()}
    print(save_checkpoint(args.destination, config, tensors))


if __name__ == "__main__":
    main()
