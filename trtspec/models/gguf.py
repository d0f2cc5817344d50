"""GGUF files as targets: converted once into the Hugging Face directory every command reads.

llama.cpp keeps models in GGUF: tensors (quantized or not) under its own names and layout, and the
config, tokenizer and chat template as metadata. `converted(path)` turns a file of a supported
family (`ARCHITECTURES`) into config.json, model.safetensors, tokenizer.json, tokenizer_config.json
and generation_config.json, in the cache under `gguf/<key>`, where the key is the file's SHA-256 and
`CONVERTER_VERSION`; later runs only hash the file (not even that while its path, size and mtime
are unchanged) and reuse the directory.

The file is read with its own reader (the `gguf` package: `GGUFReader`, `gguf.quants.dequantize`).
Dequantized weights are stored as float32: Q4_1's `d * q + m` and Q8_0's `d * q` (fp16 `d`, `m`)
are not representable in float16 or bfloat16, so a narrower type would change the model. F16 and
BF16 tensors keep their type. The run's `--dtype` applies at load, as for any checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from trtspec.errors import CheckpointError
from trtspec.fileio import (CACHE_ENV, CHECKPOINT, cache_root, key_digest, output_kind, staged_directory, stderr_line,
                            take_turns)

CONVERTER_VERSION = 1       # part of the cache key: bump when the converted directory changes
CACHE_DIR = "gguf"
INFO_FILE = "gguf.json"     # in a converted directory: the source's hash and every file's size
MAGIC = b"GGUF"

# GGUF's general.architecture -> (HF model_type, HF class)
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
                 "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp), as tokenizers pieces
_GPT2 = "gpt2"              # GPT-2's regex, which tokenizers' ByteLevel applies itself
_DIGITS = "digits"          # each number character alone, then GPT-2's regex (StarCoder, SmolLM)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "jais", "trillion"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _DIGITS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan"), _QWEN2),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def is_gguf(value) -> bool:
    """Whether a model argument names a GGUF file: a *.gguf path, or a file that starts with GGUF's magic."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    path = Path(value)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        if not path.is_file():
            return False
        with path.open("rb") as stream:
            return stream.read(4) == MAGIC
    except OSError:
        return False


def _gguf():
    try:
        import gguf
        import gguf.quants  # noqa: F401 - dequantize is looked up at call time (tests count the calls)
    except ImportError:
        raise CheckpointError("reading a GGUF file needs the gguf package: pip install gguf") from None
    return gguf


def _reader(path: Path):
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError) as exc:  # bad magic, unknown type id, truncated data
        raise CheckpointError(f"{path}: cannot read it as GGUF ({type(exc).__name__}: {exc})") from None


class _Meta:
    """GGUF metadata read for one file, every error naming it and the key."""

    def __init__(self, path: Path, reader):
        self.path = path
        self.values = {key: field.contents() for key, field in reader.fields.items()}
        self.arch = self.values.get("general.architecture")
        self.llama3_split = PRE_TOKENIZERS.get(str(self.values.get("tokenizer.ggml.pre"))) == _LLAMA3

    def get(self, key: str, default=None, kind: type | tuple = (int, float, str, bool, list)):
        value = self.values.get(key, default)
        if value is not None and not isinstance(value, kind):
            raise CheckpointError(f"{self.path}: {key} is {value!r}, expected a single {getattr(kind, '__name__', kind)}")
        return value

    def need(self, key: str, kind: type | tuple = int):
        value = self.get(key, None, kind)
        if value is None:
            raise CheckpointError(f"{self.path}: the GGUF metadata lacks {key}")
        return value

    def refuse(self, what: str) -> None:
        raise CheckpointError(f"{self.path}: {what} is not supported")

    def adds(self, role: str) -> bool:
        """Whether encoding adds the BOS / EOS token (llama.cpp's default: BOS for Llama 3's splitting only)."""
        return self.get(f"tokenizer.ggml.add_{role}_token", role == "bos" and self.llama3_split, bool)


def hf_config(meta: _Meta, tensors: dict[str, tuple[int, ...]]) -> dict:
    """config.json from the metadata (and the tensors' presence: tied head, biases, dense MoE layers)."""
    arch = meta.arch
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{meta.path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    model_type, hf_class = ARCHITECTURES[arch]
    a = f"{arch}."
    heads, hidden = meta.need(a + "attention.head_count"), meta.need(a + "embedding_length")
    head_dim = meta.get(a + "attention.key_length", None, int) or hidden // heads
    if meta.get(a + "attention.value_length", head_dim, int) != head_dim:
        meta.refuse(f"{a}attention.value_length other than the key length")
    if meta.get(a + "rope.dimension_count", head_dim, int) != head_dim:
        meta.refuse(f"{a}rope.dimension_count {meta.get(a + 'rope.dimension_count')} (partial rotary; head dim {head_dim})")
    if meta.get(a + "rope.scaling.type", "none", str) != "none":
        meta.refuse(f"{a}rope.scaling.type {meta.get(a + 'rope.scaling.type')!r}")
    if "rope_freqs.weight" in tensors:
        meta.refuse("the rope_freqs tensor (Llama 3.1-style RoPE scaling stored as factors)")
    if meta.get(a + "attention.sliding_window") is not None:
        meta.refuse(f"{a}attention.sliding_window (sliding-window attention)")
    tokens = meta.get("tokenizer.ggml.tokens", [], list)
    config = {
        "architectures": [hf_class], "model_type": model_type, "torch_dtype": "float32",
        "vocab_size": meta.get(a + "vocab_size", None, int) or len(tokens) or tensors["token_embd.weight"][0],
        "hidden_size": hidden, "num_hidden_layers": meta.need(a + "block_count"),
        "num_attention_heads": heads, "num_key_value_heads": meta.get(a + "attention.head_count_kv", heads, int),
        "head_dim": head_dim, "rope_theta": float(meta.get(a + "rope.freq_base", 10_000.0, (int, float))),
        "rms_norm_eps": float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5, (int, float))),
        "max_position_embeddings": meta.get(a + "context_length", 2048, int),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors, "hidden_act": "silu",
    }
    if arch == "qwen3moe":
        if meta.get(a + "expert_shared_count", 0, int):
            meta.refuse(f"{a}expert_shared_count (shared experts)")
        experts = meta.need(a + "expert_feed_forward_length")
        config.update(num_experts=meta.need(a + "expert_count"), num_experts_per_tok=meta.need(a + "expert_used_count"),
                      moe_intermediate_size=experts, norm_topk_prob=True, decoder_sparse_step=1,  # llama.cpp renormalises
                      mlp_only_layers=[i for i in range(config["num_hidden_layers"])
                                       if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
        config["intermediate_size"] = meta.get(a + "feed_forward_length", experts, int)
    else:
        config["intermediate_size"] = meta.need(a + "feed_forward_length")
    for name in ("bos", "eos", "padding"):
        token = meta.get(f"tokenizer.ggml.{name}_token_id", None, int)
        if token is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = token
    return config


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for Llama: its converter interleaves each head's two rotary
    halves (rows 0, d/2, 1, d/2 + 1, ...) for ggml's RoPE; the HF layout keeps them as halves."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(name: str, num_layers: int) -> str | None:
    """The HF name of a GGUF tensor (an expert stack's holds `{e}`, the expert), or None."""
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_TENSORS and suffix in ("weight", "bias"):
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or int(match[1]) >= num_layers:
        return None
    layer, part, suffix = int(match[1]), match[2], match[3]
    if part in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{suffix}"
    if part in EXPERT_TENSORS and suffix == "weight":
        return f"model.layers.{layer}.mlp.experts.{{e}}.{EXPERT_TENSORS[part]}.weight"
    return None


@functools.cache
def _dequantizable(kind) -> bool:
    """Whether the gguf package can dequantize this tensor type (asked with one zero block)."""
    gguf = _gguf()
    block_bytes = gguf.GGML_QUANT_SIZES.get(kind, (1, 0))[1]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), kind)
    except NotImplementedError:
        return False
    return block_bytes > 0


def _check_tensors(path: Path, reader, config: dict) -> None:
    """Refuse, before any dequantizing, a tensor that has no HF name or a type gguf cannot dequantize."""
    for tensor in reader.tensors:
        if _hf_name(tensor.name, config["num_hidden_layers"]) is None:
            raise CheckpointError(f"{path}: tensor {tensor.name} has no counterpart in a "
                                  f"{config['model_type']} checkpoint; it is not supported")
        if not _dequantizable(tensor.tensor_type):
            raise CheckpointError(f"{path}: tensor {tensor.name} is of quantization type {tensor.tensor_type.name}, "
                                  "which the gguf package cannot dequantize; it is not supported")


def hf_tensors(reader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its HF name and in the HF layout (rows as out-features), dequantized."""
    gguf = _gguf()
    keep = {gguf.GGMLQuantizationType.F16: torch.float16, gguf.GGMLQuantizationType.BF16: torch.bfloat16}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions fastest first
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if config["model_type"] == "llama" and tensor.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
            values = _unpermute(values, heads)
        if not values.flags.writeable:  # F32 data is a view of the file
            values = values.copy()
        weights = torch.from_numpy(values).to(keep.get(tensor.tensor_type, torch.float32))
        name = _hf_name(tensor.name, config["num_hidden_layers"])
        if "{e}" not in name:
            yield name, weights
            continue
        for e, matrix in enumerate(weights):  # [experts, out, in] -> one matrix per expert
            yield name.format(e=e), matrix.clone()


def _pre_tokenizer(meta: _Meta):
    from tokenizers import Regex, pre_tokenizers

    name = meta.get("tokenizer.ggml.pre", "default", str)
    split = PRE_TOKENIZERS.get(name)
    if split is None:
        meta.refuse(f"tokenizer.ggml.pre {name!r} (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in (_GPT2, _DIGITS))
    if split == _GPT2:
        return byte_level
    first = Regex(r"\p{N}") if split == _DIGITS else Regex(split)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(first, behavior="isolated"), byte_level])


def build_tokenizer(meta: _Meta):
    """The byte-level BPE tokenizer the metadata describes, split as llama.cpp splits it; control
    tokens are special, user-defined ones added; BOS/EOS are added where the file says so."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model", None, str)
    if kind != "gpt2":
        meta.refuse(f"tokenizer.ggml.model {kind!r} (supported: 'gpt2', byte-level BPE)")
    tokens = meta.need("tokenizer.ggml.tokens", list)
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens), list)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [], list)]
    tokenizer = Tokenizer(BPE(vocab, merges, ignore_merges=meta.llama3_split))  # as llama.cpp for Llama 3
    tokenizer.pre_tokenizer = _pre_tokenizer(meta)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    added = {role: meta.get(f"tokenizer.ggml.{role}_token_id", None, int) for role in ("bos", "eos") if meta.adds(role)}
    added = {role: index for role, index in added.items() if index is not None}
    if added:
        bos, eos = ([tokens[added[role]]] if role in added else [] for role in ("bos", "eos"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B", *eos],
            special_tokens=[(tokens[index], index) for index in added.values()])
    return tokenizer


def tokenizer_files(meta: _Meta) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json (stop ids) from the metadata."""
    tokens = meta.need("tokenizer.ggml.tokens", list)

    def token(role: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{role}_token_id", None, int)
        if index is not None and not 0 <= index < len(tokens):
            raise CheckpointError(f"{meta.path}: tokenizer.ggml.{role}_token_id {index} is not a token id")
        return tokens[index] if index is not None else None

    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                "add_bos_token": meta.adds("bos"), "add_eos_token": meta.adds("eos"),
                "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
                "unk_token": token("unknown"), "chat_template": meta.get("tokenizer.chat_template", None, str)}
    stops = [meta.get(f"tokenizer.ggml.{role}_token_id", None, int) for role in ("eos", "eot", "eom")]
    generation = {"eos_token_id": list(dict.fromkeys(i for i in stops if i is not None))}
    if meta.get("tokenizer.ggml.bos_token_id", None, int) is not None:
        generation["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    return {"tokenizer.json": build_tokenizer(meta).to_str(pretty=False),
            "tokenizer_config.json": json.dumps({k: v for k, v in settings.items() if v is not None}, indent=2) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}


def convert(path: str | os.PathLike, output: str | os.PathLike, source_sha256: str | None = None,
            echo: Callable[[str], None] | None = None) -> Path:
    """Write the HF directory of the GGUF file `path` to `output` (staged: complete or absent).
    Everything is checked before the slow part, which `echo` announces."""
    from safetensors.torch import save_file

    path = Path(path)
    reader = _reader(path)
    meta = _Meta(path, reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = hf_config(meta, shapes)
    _check_tensors(path, reader, config)
    files = tokenizer_files(meta)
    if echo is not None:
        echo(f"converting {path.name} (GGUF) into {output} (once: later runs reuse it)")
    tensors = dict(hf_tensors(reader, config))
    with staged_directory(output, CHECKPOINT) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir())}
        info = {"source": str(path), "sha256": source_sha256, "converter": CONVERTER_VERSION, "files": sizes}
        (staging / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return Path(output)


def _hash_file(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def source_sha256(path: Path) -> str:
    """The file's SHA-256, remembered in the cache by (path, device, inode, size, mtime) so that an
    unchanged 100 MB file is not read again on every run."""
    stat = path.stat()
    memo = cache_root() / CACHE_DIR / "hashes" / key_digest(
        {"path": str(path.resolve()), "dev": stat.st_dev, "ino": stat.st_ino, "size": stat.st_size,
         "mtime_ns": stat.st_mtime_ns})
    try:
        known = memo.read_text(encoding="ascii").strip()
        if len(known) == 64:
            return known
    except (OSError, UnicodeDecodeError):
        pass
    sha = _hash_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f".{memo.name}.{os.getpid()}")
        partial.write_text(sha, encoding="ascii")
        os.replace(partial, memo)
    except OSError:
        pass  # an unwritable cache only costs the hashing next time
    return sha


def _intact(entry: Path, sha: str) -> bool:
    """Whether `entry` is a complete conversion of the file with this hash by this converter."""
    try:
        info = json.loads((entry / INFO_FILE).read_text(encoding="utf-8"))
        files = info["files"]
        return (output_kind(entry) == CHECKPOINT and info["sha256"] == sha and info["converter"] == CONVERTER_VERSION
                and "model.safetensors" in files
                and all((entry / name).stat().st_size == size for name, size in files.items()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def converted(path: str | os.PathLike, echo: Callable[[str], None] = stderr_line) -> Path:
    """The HF directory of the GGUF file `path`, converted into the cache on first use."""
    import shutil

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}" if not path.exists() else f"{path} is not a file")
    try:
        sha = source_sha256(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    root = cache_root() / CACHE_DIR
    key = key_digest({"sha256": sha, "converter": CONVERTER_VERSION})
    entry = root / key
    if _intact(entry, sha):
        return entry
    with take_turns(root / f".{key}.lock"):
        if _intact(entry, sha):  # another process converted it while this one waited
            return entry
        if not os.access(root, os.W_OK | os.X_OK):
            raise CheckpointError(f"cannot convert {path.name}: the cache {root} is not writable; set {CACHE_ENV} "
                                  "to a writable directory")
        if os.path.lexists(entry):  # a damaged entry of our own (its name is our key): convert again
            echo(f"the converted GGUF {entry} is damaged; converting {path.name} again")
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        convert(path, entry, sha, echo)
    return entry
