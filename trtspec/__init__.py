"""trtspec: lossless speculative decoding with block-diffusion (DFlash) drafters.

The pipeline reads top to bottom:
    trtspec.models   Qwen3 target and DFlash drafter (plain PyTorch, static KV caches)
    trtspec.export   step graphs per block size          (folder export/)
    trtspec.engines  backends that run the step functions (folder engines/)
    trtspec.runtime  prefill -> draft -> verify -> accept -> commit (folder runtime/)
    trtspec.cli      the `trtspec` command
"""

__version__ = "0.1.0"
