"""Step 5 of the drafter recipe: put the trained drafter into the package as `smollm2-b16`.

Weights go in bfloat16 (half the size; the default dtype on CPUs with AMX is bfloat16 anyway),
with the token counts of its training responses as `draft_vocab/` (so `--draft-vocab K` works
without naming counts) and the training run's provenance in its config's lineage.

    python scripts/drafter/ship.py build/smollm2/smollm2-b16 --counts build/smollm2/draft_vocab \
        -o trtspec/assets/smollm2-b16
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from trtspec.fileio import MARKER
from trtspec.models.checkpoint import load_state_dict, read_json, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafter", type=Path, help="The trained drafter directory (train-drafter -o).")
    parser.add_argument("--counts", type=Path, help="trtspec draft-vocab output over the training responses.")
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    config = read_json(args.drafter / "config.json", "drafter")
    config["torch_dtype"] = "bfloat16"
    tensors = {name: t.to(torch.bfloat16) for name, t in load_state_dict(args.drafter, "drafter").items()}
    # saved beside, then moved in: the commands' output guard keeps every write out of the bundled models
    with tempfile.TemporaryDirectory() as staging:
        path = save_checkpoint(Path(staging) / "drafter", config, tensors)
        (path / MARKER).unlink(missing_ok=True)  # a package asset, not a command's output to overwrite later
        if args.counts is not None:
            (path / "draft_vocab").mkdir()
            for source in args.counts.iterdir():
                if source.is_file() and not source.name.startswith("."):
                    shutil.copyfile(source, path / "draft_vocab" / source.name)
        shipped = args.output / "config.json"
        if shipped.is_file() and "DFlashDraftModel" in read_json(shipped, "drafter").get("architectures", []):
            shutil.rmtree(args.output)  # an earlier shipment of a drafter
        args.output.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), args.output)
    path = args.output
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(f"{path}: {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M parameters, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
