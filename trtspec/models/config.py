"""Model configurations, read from and written to HF-style `config.json` dictionaries.

Shapes always come from here; nothing in the models hard-codes a size.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

from trtspec.errors import CheckpointError


@dataclass(frozen=True)
class Qwen3Config:
    """The decoder-stack hyper-parameters shared by the Qwen3 target and the DFlash drafter."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10_000.0  # HF's Qwen3Config default; real checkpoints set 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"config: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: dict, what: str = "config", **extra):
        """Build from a config.json dict, filling head_dim and refusing unsupported features."""
        values = dict(raw)
        # transformers >= 5 nests RoPE settings under rope_parameters; older configs use rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{what}: RoPE scaling {rope!r} is not supported")
        if "rope_theta" in rope:
            values.setdefault("rope_theta", rope["rope_theta"])
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
            raise CheckpointError(f"{what}: sliding-window attention is not supported")
        if values.get("head_dim") is None and "hidden_size" in values and "num_attention_heads" in values:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values.get("num_attention_heads")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known and v is not None}
        kwargs.update(extra)
        missing = [f.name for f in fields(cls)
                   if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise CheckpointError(f"{what}: config.json lacks {', '.join(missing)}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{what}: {exc}") from None

    def to_dict(self) -> dict:
        return asdict(self)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """DFlash's default choice of target layers to tap (e.g. 36 layers, 5 features -> 1, 9, 17, 25, 33)."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass(frozen=True)
class DFlashConfig(Qwen3Config):
    """A DFlash drafter: a Qwen3 layer stack plus what ties it to its target."""

    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    num_target_layers: int = 0
    lineage: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.target_layer_ids:
            raise CheckpointError("drafter config: dflash_config.target_layer_ids is empty")
        if not 2 <= self.block_size <= 64:
            raise CheckpointError(f"drafter config: block_size must be in [2, 64], got {self.block_size}")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_zlab(cls, raw: dict) -> "DFlashConfig":
        """Parse the z-lab `DFlashDraftModel` config.json layout."""
        dflash = raw.get("dflash_config") or {}
        if "mask_token_id" not in dflash:
            raise CheckpointError("drafter config: dflash_config.mask_token_id is missing")
        num_target_layers = raw.get("num_target_layers")
        if not isinstance(num_target_layers, int) or num_target_layers <= 0:
            raise CheckpointError("drafter config: num_target_layers must be a positive integer")
        layer_ids = dflash.get("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, int(raw.get("num_target_features", 5)))
        return cls.from_dict(
            raw, "drafter config",
            block_size=int(raw.get("block_size", 16)),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=num_target_layers,
            lineage=dict(raw.get("trtspec_lineage") or {}),
        )

    def to_zlab(self) -> dict:
        """The z-lab config.json dictionary."""
        base = {f.name: getattr(self, f.name) for f in fields(Qwen3Config)}
        config = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **base,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id,
                              "target_layer_ids": list(self.target_layer_ids)},
            "torch_dtype": "float32",
        }
        if self.lineage:
            config["trtspec_lineage"] = self.lineage
        return config
