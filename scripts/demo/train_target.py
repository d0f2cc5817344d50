"""Train the bundled demo target: a small Qwen3 causal LM on the Python standard library.

    OMP_NUM_THREADS=1 python scripts/demo/train_target.py --work build/demo-target \\
        --out trtspec/assets/demo-target --minutes 70

Stages (each is skipped when its output already exists in --work, so a restart resumes):

1. corpus      sorted stdlib *.py files, fixed 2% validation split (scripts/demo/corpus.py)
2. tokenizer   byte-level BPE, 8192 ids, <|endoftext|> = 0 (EOS), <|mask|> = 1 (DFlash mask)
3. tokens      every file encoded and joined with EOS, cached as int16 tensors
4. training    AdamW, linear warm-up then cosine decay, grad clipping, random windows drawn by
               a seeded generator; a resumable checkpoint (model, optimizer, step, elapsed time,
               RNG states) is written every --checkpoint-minutes
5. export      validation loss, then an HF directory (bf16 safetensors) for trtspec.models.load_target

The learning-rate schedule runs on training time by default: progress = elapsed / --minutes, so
the cosine always reaches its floor when the budget ends, whatever the machine's speed. Pass
--steps to run on steps instead (bit-for-bit repeatable on one machine; --minutes is then a cap).
`--export-only` skips training and exports the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import corpus_manifest, read_pack, read_text, split_files  # noqa: E402

from trtspec.models import Qwen3Config, Qwen3Target, load_target  # noqa: E402
from trtspec.models.checkpoint import save_checkpoint  # noqa: E402
from trtspec.runtime.engine import EngineConfig, EngineCore  # noqa: E402
from trtspec.runtime.request import GenerationConfig  # noqa: E402
from trtspec.runtime.runner import BatchRunner  # noqa: E402
from trtspec.runtime.schedule import AR  # noqa: E402

EOS, MASK = "<|endoftext|>", "<|mask|>"
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
SAMPLE_PROMPT = "def fibonacci(n):\n"


# ---------------------------------------------------------------- tokenizer and tokens

# Qwen2/Qwen3's pre-tokenisation split. Unlike GPT-2's, it keeps a line break out of the next
# line's indentation ("):\n" | "   " | " return"), so a prompt that ends with "\n" (every
# HumanEval prompt) tokenizes exactly as the same text does in the middle of a training file.
PRE_TOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE with Qwen's split regex; special tokens take ids 0 and 1."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((read_text(p) for p in files), trainer=trainer, length=len(files))
    assert tokenizer.token_to_id(EOS) == 0 and tokenizer.token_to_id(MASK) == 1
    return tokenizer


def encode_texts(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one int16 stream, each followed by EOS (id 0); encoded in parallel."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int16)


def prepare_data(work: Path, vocab_size: int, with_packages: bool, reuse_tokenizer: Path | None,
                 pack: Path | None = None):
    """Tokenizer, training stream, validation stream and the stdlib-only validation stream.

    The stdlib validation files are the first demo target's, so its perplexity stays comparable
    across corpora; `reuse_tokenizer` keeps an existing vocabulary instead of training one. With
    `pack` the corpus comes from a packed file (a machine without the packages installed, such as
    the GPU host); its corpus.json lies beside it.
    """
    from tokenizers import Tokenizer
    tok_path = work / "tokenizer.json"
    if not tok_path.exists():
        if reuse_tokenizer is not None:
            tok_path.write_text(reuse_tokenizer.read_text(encoding="utf-8"), encoding="utf-8")
        elif pack is not None:
            raise SystemExit("--pack needs --reuse-tokenizer (the tokenizer is trained from the installed files)")
        else:
            train_tokenizer(split_files(with_packages)[0], vocab_size).save(str(tok_path))
            print(f"tokenizer trained -> {tok_path}", flush=True)
    tokenizer = Tokenizer.from_file(str(tok_path))
    data_path = work / "tokens.pt"
    if not data_path.exists():
        if pack is not None:
            texts = read_pack(pack)
            train, stdlib_valid = texts["train"], texts["valid-stdlib"]
            valid = stdlib_valid + texts["valid"]  # the split's order: the stdlib's files first
        else:
            train_files, valid_files = split_files(with_packages)
            stdlib_files = set(split_files(with_packages=False)[1])
            train = [read_text(p) for p in train_files]
            valid = [read_text(p) for p in valid_files]
            stdlib_valid = [text for p, text in zip(valid_files, valid) if p in stdlib_files]
        torch.save({"train": encode_texts(tokenizer, train), "valid": encode_texts(tokenizer, valid),
                    "valid_stdlib": encode_texts(tokenizer, stdlib_valid)}, data_path)
    data = torch.load(data_path)
    manifest = (pack.with_name("corpus.json").read_text() if pack is not None
                else json.dumps(corpus_manifest(with_packages), indent=2) + "\n")
    (work / "corpus.json").write_text(manifest)
    print(f"corpus: {len(data['train'])} training tokens, {len(data['valid'])} validation tokens "
          f"({len(data['valid_stdlib'])} of them the stdlib validation files)", flush=True)
    return tokenizer, data["train"], data["valid"], data["valid_stdlib"]


# ---------------------------------------------------------------- model and schedule

def model_config(a) -> Qwen3Config:
    return Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                       num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                       head_dim=a.head_dim, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048,
                       tie_word_embeddings=True)


def init_weights(model: Qwen3Target, std: float = 0.02) -> None:
    """GPT-2 style: N(0, 0.02), output projections scaled by 1/sqrt(2 * layers); norms at 1."""
    residual_std = std / math.sqrt(2 * model.config.num_hidden_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(param)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            torch.nn.init.normal_(param, 0.0, residual_std)
        else:
            torch.nn.init.normal_(param, 0.0, std)


def learning_rate(progress: float, a) -> float:
    """Linear warm-up over the first --warmup fraction, then cosine down to --min-lr-ratio."""
    if progress < a.warmup:
        return a.lr * max(progress, 1e-3) / a.warmup
    t = min(1.0, (progress - a.warmup) / (1.0 - a.warmup))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` windows of seq + 1 tokens at uniform random starts (drawn on the CPU, so a run
    draws the same windows on any device), gathered where the stream lies."""
    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen).to(stream.device)
    return stream[starts[:, None] + torch.arange(seq + 1, device=stream.device)].long()


@torch.no_grad()
def validation_loss(model: Qwen3Target, stream: torch.Tensor, seq: int, max_windows: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over consecutive non-overlapping windows."""
    model.eval()
    total, count = 0.0, 0
    starts = range(0, len(stream) - 1, seq)
    for i, s in enumerate(starts):
        if max_windows is not None and i >= max_windows:
            break
        window = stream[s:s + seq + 1].long()[None].to(model.device)
        logits, _ = model(window[:, :-1], 0, None)
        total += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    model.train()
    return total / count


@torch.no_grad()
def greedy_sample(model: Qwen3Target, tokenizer, prompt: str, new_tokens: int = 48) -> str:
    """The prompt and the model's greedy continuation (up to EOS, id 0, which is not shown), through
    trtspec's own decode loop."""
    model.eval()
    config = GenerationConfig(block=AR, max_new_tokens=new_tokens, stop_ids=(0,))
    engine = EngineCore(BatchRunner.eager(model, None, 1), config=EngineConfig(max_running=1, prefill_chunk=0))
    out = engine.generate([tokenizer.encode(prompt).ids], [config])[0].tokens
    model.train()
    return prompt + tokenizer.decode(out[:-1] if out[-1:] == [0] else out)


def safe_sample(model: Qwen3Target, tokenizer, prompt: str, new_tokens: int = 48) -> str:
    """greedy_sample, or the error it raised: a sample is a progress report, never a reason to
    lose a training run."""
    try:
        return greedy_sample(model, tokenizer, prompt, new_tokens)
    except Exception as error:  # noqa: BLE001 - reported, training goes on
        model.train()
        return f"<sample failed: {type(error).__name__}: {error}>"


# ---------------------------------------------------------------- checkpoints and export

def save_resumable(path: Path, model, optimizer, state: dict, gen: torch.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state,
                "data_rng": gen.get_state(), "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def export(out: Path, model: Qwen3Target, tokenizer_path: Path, work: Path, info: dict) -> None:
    config = model.config
    hf_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **config.to_dict(),
        "hidden_act": "silu",
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "trtspec_demo": info,
    }
    # Tied embeddings: lm_head.weight is the same tensor as embed_tokens, so it is not stored.
    tensors = {name: t.to("cpu", torch.bfloat16) for name, t in model.state_dict().items() if name != "lm_head.weight"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS, "pad_token": EOS, "mask_token": MASK,
        "add_bos_token": False, "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "do_sample": False}
    extra = {
        "generation_config.json": json.dumps(generation_config, indent=2) + "\n",
        "tokenizer.json": tokenizer_path.read_text(encoding="utf-8"),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
        "corpus.json": (work / "corpus.json").read_text(encoding="utf-8"),
    }
    save_checkpoint(out, hf_config, tensors, extra)
    print(f"exported {out}: " + ", ".join(f"{p.name} {p.stat().st_size / 1e6:.2f} MB" for p in sorted(out.iterdir())),
          flush=True)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("build/demo-target"), help="scratch dir (build/ is git-ignored)")
    p.add_argument("--out", type=Path, default=Path("trtspec/assets/demo-target"))
    p.add_argument("--minutes", type=float, default=70.0, help="training-time budget (schedule length)")
    p.add_argument("--steps", type=int, default=0, help="run the schedule on steps instead of time")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--export-only", action="store_true", help="export the latest checkpoint, no training")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]; on CUDA the steps run under bf16 autocast")
    p.add_argument("--valid-windows", type=int, default=None,
                   help="measure the final validation loss on at most this many windows (a quick dry run)")
    p.add_argument("--pack", type=Path, default=None,
                   help="read the corpus from this packed file (scripts/demo/corpus.py --pack), not the installed files")
    p.add_argument("--stdlib-only", action="store_true", help="the first demo target's corpus (no packages)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this target directory's weights (continued pre-training; same config)")
    p.add_argument("--reuse-tokenizer", type=Path, default=None,
                   help="copy this tokenizer.json instead of training one (keeps the vocabulary)")
    # model
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1152)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    # optimisation
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the schedule")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    a.work.mkdir(parents=True, exist_ok=True)
    tokenizer, train_stream, valid_stream, stdlib_valid_stream = prepare_data(
        a.work, a.vocab, not a.stdlib_only, a.reuse_tokenizer, a.pack)
    device = torch.device(a.device)
    train_stream = train_stream.to(device)

    def autocast():  # fp32 master weights; on CUDA the forward and backward run in bf16 (the shipped dtype)
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    torch.manual_seed(a.seed)
    config = model_config(a)
    model = Qwen3Target(config)
    init_weights(model)
    if a.init_from is not None:  # continued pre-training: start from an earlier demo target's weights
        earlier = load_target(a.init_from, dtype=torch.float32)
        if earlier.config.to_dict() != config.to_dict():
            raise SystemExit(f"{a.init_from} has another model config; pass matching --hidden/--layers/...")
        model.load_state_dict(earlier.state_dict())
        print(f"initialised from {a.init_from}", flush=True)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(a.seed)
    state = {"step": 0, "elapsed": 0.0, "tokens": 0, "config": config.to_dict(), "loss_ema": None}

    ckpt_path = a.work / "target-ckpt.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location=device)
        if ckpt["state"]["config"] != config.to_dict():
            raise SystemExit(f"{ckpt_path} was trained with another model config; move it away to start over")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = ckpt["state"]
        gen.set_state(ckpt["data_rng"].cpu())
        torch.set_rng_state(ckpt["torch_rng"].cpu())
        print(f"resumed from {ckpt_path}: step {state['step']}, {state['elapsed'] / 60:.1f} min trained", flush=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {config}\nparameters {n_params / 1e6:.2f}M (tied embeddings)", flush=True)

    budget = a.minutes * 60.0

    def progress() -> float:
        if a.steps:
            return state["step"] / a.steps
        return state["elapsed"] / budget

    def done() -> bool:
        return progress() >= 1.0 or state["elapsed"] >= budget

    model.train()
    last_ckpt = time.monotonic()
    bar = tqdm(total=a.steps or int(budget), initial=state["step"] if a.steps else int(state["elapsed"]),
               unit="step" if a.steps else "s", mininterval=20, file=sys.stdout, dynamic_ncols=False, ncols=120)
    while not a.export_only and not done():
        t0 = time.perf_counter()
        lr = learning_rate(progress(), a)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(train_stream, a.batch, a.seq, gen)
        with autocast():
            logits, _ = model(batch[:, :-1], 0, None)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":  # the step's time, not its launch's: the budget counts GPU time
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        state["step"] += 1
        state["elapsed"] += dt
        state["tokens"] += a.batch * a.seq
        value = loss.item()
        state["loss_ema"] = value if state["loss_ema"] is None else 0.98 * state["loss_ema"] + 0.02 * value
        bar.update(1 if a.steps else int(state["elapsed"]) - bar.n)
        bar.set_postfix(step=state["step"], loss=f"{state['loss_ema']:.3f}", lr=f"{lr:.2e}",
                        tok_s=f"{a.batch * a.seq / dt:.0f}", refresh=False)
        if state["step"] % 50 == 0:
            tqdm.write(f"step {state['step']} loss {value:.4f} ema {state['loss_ema']:.4f} lr {lr:.3e} "
                       f"gnorm {float(grad_norm):.2f} tok/s {a.batch * a.seq / dt:.0f} "
                       f"trained {state['elapsed'] / 60:.1f}/{a.minutes:g} min", file=sys.stdout)
            sys.stdout.flush()
        if time.monotonic() - last_ckpt >= a.checkpoint_minutes * 60:
            save_resumable(ckpt_path, model, optimizer, state, gen)
            quick = validation_loss(model, valid_stream, a.seq, max_windows=16)
            tqdm.write(f"checkpoint step {state['step']} -> {ckpt_path}; val loss (16 windows) {quick:.4f}\n"
                       f"sample: {safe_sample(model, tokenizer, SAMPLE_PROMPT)!r}", file=sys.stdout)
            sys.stdout.flush()
            last_ckpt = time.monotonic()
    bar.close()
    if not a.export_only:
        save_resumable(ckpt_path, model, optimizer, state, gen)

    val_fp32 = validation_loss(model, valid_stream, a.seq, a.valid_windows)
    # The shipped weights are bf16: measure the model exactly as it will be loaded (bf16 -> fp32).
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    val = validation_loss(model, valid_stream, a.seq, a.valid_windows)
    val_stdlib = validation_loss(model, stdlib_valid_stream, a.seq, a.valid_windows)
    print(f"final: step {state['step']}, {state['tokens']} tokens, {state['elapsed'] / 60:.1f} min, "
          f"train loss ema {state['loss_ema']:.4f}, validation loss {val:.4f} nats/token with bf16 weights "
          f"(fp32 {val_fp32:.4f}; ppl {math.exp(val):.2f}) over {len(valid_stream)} tokens; stdlib validation files "
          f"{val_stdlib:.4f} (ppl {math.exp(val_stdlib):.2f}) over {len(stdlib_valid_stream)} tokens", flush=True)
    manifest = json.loads((a.work / "corpus.json").read_text())
    info = {
        "description": "trtspec demo target, trained from scratch on the CPython stdlib"
                       + ("" if a.stdlib_only else " and well-kept Python packages") + " (scripts/demo/train_target.py)",
        "mask_token_id": 1,
        "corpus_sha256": manifest["sha256"],
        "initialised_from": (json.loads((a.init_from / "config.json").read_text()).get("trtspec_demo")
                             if a.init_from is not None else None),
        "seed": a.seed, "steps": state["step"], "train_tokens": state["tokens"],
        "train_minutes": round(state["elapsed"] / 60, 2), "batch": a.batch, "seq_len": a.seq, "lr": a.lr,
        "validation_loss": round(val, 4), "validation_loss_fp32": round(val_fp32, 4),
        "validation_tokens": len(valid_stream),
        "stdlib_validation_loss": round(val_stdlib, 4), "stdlib_validation_tokens": len(stdlib_valid_stream),
        "threads": a.threads, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    (a.work / "final.json").write_text(json.dumps(info, indent=2) + "\n")
    export(a.out, model, a.work / "tokenizer.json", a.work, info)
    print(f"sample: {safe_sample(model, tokenizer, SAMPLE_PROMPT, 80)!r}", flush=True)


if __name__ == "__main__":
    main()
