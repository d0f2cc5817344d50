import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import save_hf_target, save_random_drafter  # noqa: E402

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to a busy machine


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> Path:
    """A random Qwen3 written by transformers, with a trained BPE tokenizer and chat template."""
    return save_hf_target(tmp_path_factory.mktemp("ckpt") / "target")


@pytest.fixture(scope="session")
def drafter_dir(target_dir, tmp_path_factory) -> Path:
    from trtspec.models import load_target
    return save_random_drafter(tmp_path_factory.mktemp("ckpt") / "drafter", load_target(target_dir))
