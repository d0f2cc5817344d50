"""Model configurations, read from and written to HF-style `config.json` dictionaries.

Shapes always come from here; nothing in the models hard-codes a size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from trtspec.errors import CheckpointError, TrtspecError
from trtspec.limits import check_block_size
from trtspec.validate import POSITIVE, POSITIVE_INT, Fields


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
            POSITIVE_INT.check(getattr(self, name), name)
        for name in ("rope_theta", "rms_norm_eps"):  # <= 0 gives NaN logits that decode as EOS
            POSITIVE.check(getattr(self, name), name)
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_dict(cls, raw: dict, what: str = "config", **extra):
        """Build from a config.json dict (`what`: its file, named in every error), filling head_dim
        and refusing unsupported features and wrongly typed or out-of-range fields."""
        try:
            return cls(**cls._fields_of(Fields(raw, what)), **extra)
        except TrtspecError as exc:
            if str(exc).startswith(f"{what}:"):
                raise
            raise CheckpointError(f"{what}: {exc}") from None

    @classmethod
    def _fields_of(cls, f: Fields) -> dict:
        # transformers >= 5 nests RoPE settings under rope_parameters; older configs use rope_scaling.
        rope = None
        for key in ("rope_parameters", "rope_scaling"):
            settings = f.obj(key, None)
            if settings is not None and settings.data:
                kind = settings.text("rope_type", None) or settings.text("type", "default")
                if kind != "default":
                    raise CheckpointError(f"{f.source}: RoPE scaling {settings.data!r} is not supported")
                rope = rope or settings
        if f.boolean("use_sliding_window", False) or "sliding_attention" in f.strings("layer_types", []):
            raise CheckpointError(f"{f.source}: sliding-window attention is not supported")
        values = {name: f.integer(name, POSITIVE_INT) for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
        values["num_key_value_heads"] = f.integer("num_key_value_heads", POSITIVE_INT, values["num_attention_heads"])
        if f.has("head_dim"):
            values["head_dim"] = f.integer("head_dim", POSITIVE_INT)
        elif values["hidden_size"] % values["num_attention_heads"]:
            f.fail("hidden_size", f"({values['hidden_size']}) is not a multiple of num_attention_heads "
                                  f"({values['num_attention_heads']}) and head_dim is not given")
        else:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        theta = rope.number("rope_theta", POSITIVE, None) if rope is not None else None
        values["rope_theta"] = f.number("rope_theta", POSITIVE, theta if theta is not None else 10_000.0)
        values["rms_norm_eps"] = f.number("rms_norm_eps", POSITIVE, 1e-6)
        values["max_position_embeddings"] = f.integer("max_position_embeddings", POSITIVE_INT, 40960)
        values["tie_word_embeddings"] = f.boolean("tie_word_embeddings", False)
        values["attention_bias"] = f.boolean("attention_bias", False)
        return values

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
        check_block_size(self.block_size, "block_size")
        POSITIVE_INT.check(self.num_target_layers, "num_target_layers")
        if not self.target_layer_ids:
            raise CheckpointError("dflash_config.target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.num_target_layers]
        if bad:
            raise CheckpointError(f"dflash_config.target_layer_ids {bad} are out of range for a "
                                  f"{self.num_target_layers}-layer target (num_target_layers)")
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) \
                or not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"dflash_config.mask_token_id must be a token id in [0, {self.vocab_size}), "
                                  f"got {self.mask_token_id!r}")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_zlab(cls, raw: dict, what: str = "drafter config") -> "DFlashConfig":
        """Parse the z-lab `DFlashDraftModel` config.json layout (`what`: its file, named in errors)."""
        f = Fields(raw, what)
        dflash = f.obj("dflash_config")
        num_target_layers = f.integer("num_target_layers", POSITIVE_INT)
        layer_ids = dflash.ints("target_layer_ids", None, nonempty=True)
        if layer_ids is None:
            count = f.integer("num_target_features", POSITIVE_INT, 5)
            layer_ids = default_target_layer_ids(num_target_layers, count)
        lineage = f.obj("trtspec_lineage", None)
        return cls.from_dict(
            raw, what,
            block_size=f.integer("block_size", POSITIVE_INT, 16),
            mask_token_id=dflash.integer("mask_token_id"),
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target_layers,
            lineage=dict(lineage.data) if lineage is not None else {},
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
