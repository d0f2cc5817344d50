"""Models: the target (Qwen3, Llama 3.x and Qwen3-MoE families) and the DFlash drafter, with their
checkpoint formats."""

from trtspec.models.config import (TARGET_FAMILIES, DFlashConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig,
                                   default_target_layer_ids, target_config_from_dict)
from trtspec.models.dflash import DFlashDrafter, check_pair, load_drafter, save_drafter
from trtspec.models.layers import KVCache
from trtspec.models.target import DecoderTarget, Qwen3Target, load_target, load_target_config

__all__ = ["TARGET_FAMILIES", "DFlashConfig", "DFlashDrafter", "DecoderTarget", "KVCache", "LlamaConfig",
           "Qwen3Config", "Qwen3MoeConfig", "Qwen3Target", "check_pair", "default_target_layer_ids",
           "load_drafter", "load_target", "load_target_config", "save_drafter", "target_config_from_dict"]
