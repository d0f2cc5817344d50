"""Model configurations, read from and written to HF-style `config.json` dictionaries.

Shapes always come from here; nothing in the models hard-codes a size. The target families
(`TARGET_FAMILIES`, keyed by `model_type`) are one decoder that differs only in what its config
says: Qwen3 (q/k RMSNorm, plain RoPE), Llama 3.x (no q/k norm, optional `llama3` RoPE scaling) and
Qwen3-MoE (Qwen3 with top-k routed experts in its sparse layers). Anything else a config asks for
is refused at the door with one line naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from trtspec.errors import CheckpointError, TrtspecError
from trtspec.limits import check_block_size
from trtspec.validate import NON_NEGATIVE_INT, POSITIVE, POSITIVE_INT, Fields


def _refuse(f: Fields, key: str, message: str) -> None:
    """An unsupported feature of a checkpoint's config: one line naming the file and the field."""
    raise CheckpointError(f"{f.source}: {f.prefix}{key} {message}")


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

    model_type: ClassVar[str] = "qwen3"
    qk_norm: ClassVar[bool] = True                        # per-head RMSNorm of queries and keys
    rope_types: ClassVar[tuple[str, ...]] = ("default",)  # RoPE kinds this family accepts

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
    def _rope(cls, f: Fields) -> Fields | None:
        """The RoPE settings (transformers >= 5 nests them under rope_parameters; older configs use
        rope_scaling), refusing a kind this family does not implement."""
        chosen = None
        for key in ("rope_parameters", "rope_scaling"):
            settings = f.obj(key, None)
            if settings is None or not settings.data:
                continue
            field_name = "rope_type" if settings.has("rope_type") else "type"
            kind = settings.text(field_name, "default")
            if kind not in cls.rope_types:
                raise CheckpointError(f"{f.source}: {key}.{field_name} {kind!r} is not supported for model_type "
                                      f"{cls.model_type!r} (supported: {', '.join(cls.rope_types)})")
            if chosen is None or kind != "default":
                chosen = settings
            if settings.number("partial_rotary_factor", POSITIVE, 1.0) != 1.0:
                _refuse(settings, "partial_rotary_factor", "other than 1 is not supported")
        return chosen

    @classmethod
    def _fields_of(cls, f: Fields) -> dict:
        rope = cls._rope(f)
        if f.boolean("use_sliding_window", False):
            _refuse(f, "use_sliding_window", "is true: sliding-window attention is not supported")
        if "sliding_attention" in f.strings("layer_types", []):
            _refuse(f, "layer_types", "has sliding_attention layers: sliding-window attention is not supported")
        if f.text("hidden_act", "silu") != "silu":
            _refuse(f, "hidden_act", f"{f.text('hidden_act')!r} is not supported (only 'silu')")
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

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes its tokens to experts (only Qwen3-MoE's do)."""
        return False

    @property
    def rope_scaling_parameters(self) -> dict | None:
        """The RoPE frequency scaling this config asks for (None: plain RoPE)."""
        return None

    def to_dict(self) -> dict:
        """The fields as a dict that `target_config_from_dict` reads back (engine manifests and
        training fingerprints hold it; a Qwen3 dict is written as before other families existed)."""
        data = asdict(self)
        return data if self.model_type == "qwen3" else {"model_type": self.model_type, **data}


LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class LlamaConfig(Qwen3Config):
    """Llama 3.x: Qwen3's decoder without q/k norm, with optional `llama3` RoPE frequency scaling."""

    rope_scaling: dict = field(default_factory=dict)  # the four LLAMA3_ROPE parameters, or {} for plain RoPE
    max_position_embeddings: int = 2048

    model_type: ClassVar[str] = "llama"
    qk_norm: ClassVar[bool] = False
    rope_types: ClassVar[tuple[str, ...]] = ("default", "llama3")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.rope_scaling:
            return
        if sorted(self.rope_scaling) != sorted(("rope_type",) + LLAMA3_ROPE) or self.rope_scaling["rope_type"] != "llama3":
            raise CheckpointError(f"rope_scaling must hold rope_type 'llama3' and {', '.join(LLAMA3_ROPE)}, "
                                  f"got {self.rope_scaling!r}")
        for name in LLAMA3_ROPE:
            POSITIVE.check(self.rope_scaling[name], f"rope_scaling.{name}")
        if self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
            raise CheckpointError("rope_scaling.high_freq_factor must be larger than rope_scaling.low_freq_factor")

    @classmethod
    def _fields_of(cls, f: Fields) -> dict:
        values = super()._fields_of(f)
        if f.boolean("mlp_bias", False):
            _refuse(f, "mlp_bias", "is true: MLP biases are not supported")
        values["max_position_embeddings"] = f.integer("max_position_embeddings", POSITIVE_INT, 2048)
        rope = cls._rope(f)
        kind = rope.data.get("rope_type", rope.data.get("type")) if rope is not None else "default"
        if kind == "llama3":
            values["rope_scaling"] = {"rope_type": "llama3", **{
                name: rope.integer(name, POSITIVE_INT) if name.startswith("original") else rope.number(name, POSITIVE)
                for name in LLAMA3_ROPE}}
        return values

    @property
    def rope_scaling_parameters(self) -> dict | None:
        return self.rope_scaling or None


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE: Qwen3 whose sparse layers route each token to its top-k of `num_experts` SwiGLU
    experts (width `moe_intermediate_size`); the others, every layer listed in `mlp_only_layers`
    and those not on the `decoder_sparse_step` grid, keep a dense MLP of `intermediate_size`."""

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    model_type: ClassVar[str] = "qwen3_moe"

    def __post_init__(self) -> None:
        super().__post_init__()
        NON_NEGATIVE_INT.check(self.num_experts, "num_experts")
        for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            POSITIVE_INT.check(getattr(self, name), name)
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise CheckpointError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                                  f"({self.num_experts})")
        if not isinstance(self.norm_topk_prob, bool):
            raise CheckpointError(f"norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")

    @classmethod
    def _fields_of(cls, f: Fields) -> dict:
        values = super()._fields_of(f)
        # transformers >= 5 writes num_experts as num_local_experts
        key = "num_experts" if f.has("num_experts") or not f.has("num_local_experts") else "num_local_experts"
        values["num_experts"] = f.integer(key, NON_NEGATIVE_INT)
        values["num_experts_per_tok"] = f.integer("num_experts_per_tok", POSITIVE_INT)
        values["moe_intermediate_size"] = f.integer("moe_intermediate_size", POSITIVE_INT)
        values["norm_topk_prob"] = f.boolean("norm_topk_prob", False)
        values["decoder_sparse_step"] = f.integer("decoder_sparse_step", POSITIVE_INT, 1)
        values["mlp_only_layers"] = tuple(f.ints("mlp_only_layers", []))
        return values

    def to_dict(self) -> dict:
        return {**super().to_dict(), "mlp_only_layers": list(self.mlp_only_layers)}

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


TARGET_FAMILIES: dict[str, type[Qwen3Config]] = {
    family.model_type: family for family in (Qwen3Config, LlamaConfig, Qwen3MoeConfig)}


def target_config_from_dict(raw: dict, what: str = "config") -> Qwen3Config:
    """A target's config, of the family its `model_type` names (a config without one is Qwen3)."""
    model_type = raw.get("model_type", "qwen3")
    family = TARGET_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise CheckpointError(f"{what}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(TARGET_FAMILIES)})")
    return family.from_dict(raw, what)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """DFlash's default choice of target layers to tap (e.g. 36 layers, 5 features -> 1, 9, 17, 25, 33).
    On a target too shallow for that spread to give distinct layers the taps spread over all its
    layers instead (tapping a layer twice only repeats its features); more taps than layers is
    refused."""
    if not 1 <= num_features <= num_target_layers:
        raise TrtspecError(f"--num-features {num_features} is more than the target's {num_target_layers} layers: "
                           f"a drafter taps each layer at most once; give at most {num_target_layers}")
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4  # from layer 1 to layer L - 3
    ids = [round(1 + i * span / (num_features - 1)) for i in range(num_features)]
    if span < 0 or len(set(ids)) < num_features:  # (a 2- or 3-layer target gave -1 or a falling list)
        ids = [round(i * (num_target_layers - 1) / (num_features - 1)) for i in range(num_features)]
    return ids


def check_target_layer_ids(layer_ids: tuple[int, ...] | list[int], num_target_layers: int) -> None:
    """Refuse taps a new drafter cannot use: a layer the target lacks, or one tapped twice (its
    features would enter twice, silently, in place of another layer's)."""
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise TrtspecError(f"--target-layer-ids {','.join(map(str, bad))} are not layers of the "
                           f"{num_target_layers}-layer target (0 to {num_target_layers - 1})")
    repeated = sorted({i for i in layer_ids if list(layer_ids).count(i) > 1})
    if repeated:
        raise TrtspecError(f"--target-layer-ids taps layer {','.join(map(str, repeated))} more than once; "
                           "give each layer once")


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
