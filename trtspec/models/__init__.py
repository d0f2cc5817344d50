"""Models: the Qwen3 target and the DFlash drafter, with their checkpoint formats."""

from trtspec.models.config import DFlashConfig, Qwen3Config, default_target_layer_ids
from trtspec.models.dflash import DFlashDrafter, check_pair, load_drafter, save_drafter
from trtspec.models.layers import KVCache
from trtspec.models.qwen3 import Qwen3Target, load_target

__all__ = ["DFlashConfig", "DFlashDrafter", "KVCache", "Qwen3Config", "Qwen3Target", "check_pair",
           "default_target_layer_ids", "load_drafter", "load_target", "save_drafter"]
