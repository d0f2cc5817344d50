"""Tiny real checkpoints built inside the tests: a random Qwen3 saved by transformers, a byte-level
BPE tokenizer trained with `tokenizers`, and DFlash drafters saved in the z-lab layout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trtspec.models import DFlashConfig, DFlashDrafter, Qwen3Target, save_drafter

EOS, MASK = "<|endoftext|>", "<|mask|>"
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Speculative decoding drafts a block of tokens and the target verifies it in one pass.",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 20


CODE_WORDS = ["def", "return", "x", "y", "for", "in", "range", "(", ")", ":", "print", "if", "else", "=", "+", "1"]


def code_prompts(count: int, words: int = 6, seed: int = 0) -> list[str]:
    """`count` code-like prompts of `words` random CODE_WORDS each: what the tiny trained drafter
    learned the tiny target's continuations of (`train_tiny_drafter`), so its acceptance is high there."""
    gen = torch.Generator().manual_seed(seed)
    return [" ".join(CODE_WORDS[i] for i in torch.randint(0, len(CODE_WORDS), (words,), generator=gen).tolist())
            for _ in range(count)]


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # a short original context: the tests' positions cross it


def hf_family(family: str, **options):
    """transformers' config and model classes of a target family, and its family-specific options
    (Llama: llama3 RoPE scaling and attention biases; Qwen3-MoE: 4 experts, top-2, layer 1 dense)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)
    defaults = {
        "qwen3": {},
        "llama": {"rope_scaling": LLAMA3_ROPE, "attention_bias": True},
        "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                      "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1},
    }[family]
    classes = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
               "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[family]
    return (*classes, {**defaults, **options})


def save_hf_target(directory: Path, *, vocab_size: int = 320, hidden: int = 64, layers: int = 4,
                   heads: int = 4, kv_heads: int = 2, head_dim: int = 16, max_positions: int = 4096,
                   tie: bool = False, seed: int = 0, with_tokenizer: bool = True, family: str = "qwen3",
                   **family_options) -> Path:
    """A random target of `family` (qwen3, llama, qwen3_moe) written by transformers' own save_pretrained."""
    HFConfig, HFModel, options = hf_family(family, **family_options)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(vocab_size - 8) if with_tokenizer else None
    eos = tokenizer.token_to_id(EOS) if tokenizer else 0
    config = HFConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=tie,
                      rope_theta=1_000_000.0, eos_token_id=eos, bos_token_id=None, **options)
    model = HFModel(config)
    with torch.no_grad():  # a larger init than HF's 0.02 so the logits are far from uniform
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # (fused MoE experts are 3-D: [experts, out, in])
                param.normal_(0, 0.5 / param.shape[-1] ** 0.5 if "embed" not in name else 1.0)
            else:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    if tokenizer:
        tokenizer.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": EOS,
            "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        }))
    return directory


def random_drafter(target: Qwen3Target, *, layers: int = 1, layer_ids=(0, 1), block_size: int = 16,
                   mask_token_id: int = 1, seed: int = 1, scale: float = 1.0) -> DFlashDrafter:
    t = target.config
    config = DFlashConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                          intermediate_size=t.intermediate_size, num_hidden_layers=layers,
                          num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                          head_dim=t.head_dim, rope_theta=t.rope_theta, rms_norm_eps=t.rms_norm_eps,
                          max_position_embeddings=t.max_position_embeddings, block_size=block_size,
                          mask_token_id=mask_token_id, target_layer_ids=tuple(layer_ids),
                          num_target_layers=t.num_hidden_layers)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() == 2:
                param.normal_(0, scale / param.shape[-1] ** 0.5)
            else:  # norm weights away from 1, so a misplaced norm changes the output
                param.uniform_(0.5, 1.5)
    return drafter.to(target.dtype).bind(target)


def save_random_drafter(directory: Path, target: Qwen3Target, **kwargs) -> Path:
    return save_drafter(random_drafter(target, **kwargs), directory)


TRAINED_PROMPTS = 96  # code_prompts(TRAINED_PROMPTS) trained the tiny drafter; later ones are held out


def train_tiny_drafter(target_dir: Path, directory: Path) -> Path:
    """A DFlash drafter (B = 16, one layer) trained for 400 steps on the tiny target's own greedy
    continuations of `code_prompts(TRAINED_PROMPTS)` (~20 s on one thread), with a BlockPilot policy
    in its blockpilot/ as a bundled drafter ships one: B = 8 for short prompts, 16 for long ones.
    On held-out code prompts its tau at B = 16 is about 2 and every depth of acceptance occurs;
    on other text (HumanEval: the tiny target writes bytes there) it accepts next to nothing."""
    from trtspec.api import Pipeline
    from trtspec.blockpilot.training import train_policy
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.schedule import AR
    from trtspec.training.data import generate_data, read_training_data
    from trtspec.training.trainer import TrainConfig, train_drafter

    pipeline = Pipeline(target_dir)
    data = generate_data(pipeline, [{"prompt": p} for p in code_prompts(TRAINED_PROMPTS)],
                         GenerationConfig(block=AR, max_new_tokens=64), directory.parent / f"{directory.name}.jsonl",
                         progress=False)
    config = TrainConfig(block_size=16, num_layers=1, num_features=2,
                         mask_token_id=pipeline.codec.tokenizer.token_to_id(MASK), steps=400, batch_size=8,
                         anchors_per_sequence=8, lr=6e-3, checkpoint_every=400)
    train_drafter(pipeline.target, read_training_data(data, pipeline.codec), config, directory, progress=False)
    lengths = torch.linspace(1.0, 5.0, 64)[:, None]  # the "length" feature: log of the prompt's length
    speeds = torch.stack([torch.where(lengths[:, 0] < 3.0, 2.0, 1.0), torch.where(lengths[:, 0] < 3.0, 1.0, 2.0)], 1)
    policy = train_policy(lengths, speeds, (8, 16), ("length",), hidden=8, steps=100)
    # saved beside the drafter, then moved in: trtspec writes nothing inside a checkpoint it made
    policy.save(directory.parent / f"{directory.name}.policy").rename(directory / "blockpilot")
    return directory


def tiny_config(vocab_size: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                max_positions: int = 512):
    from trtspec.models import Qwen3Config
    return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=hidden // heads, rope_theta=1_000_000.0, max_position_embeddings=max_positions)


def predictable_pair(seed: int = 1, vocab_size: int = 64, beta: float = 1.2, likely_token: int = 7,
                     **config) -> tuple[Qwen3Target, DFlashDrafter]:
    """A target that mostly (not always) continues with `likely_token`, and a real drafter that
    mostly proposes it, so cycles accept nothing, part of the block, or all of it.

    All embeddings share a large common direction g and the target's lm_head row for
    `likely_token` points along g; the layers add enough context noise that the target sometimes
    prefers another token. The drafter's layers are damped, so its output stays near the embedding
    of the mask token and it proposes `likely_token` at every position.
    """
    torch.manual_seed(seed)
    target = Qwen3Target(tiny_config(vocab_size=vocab_size, **config)).eval()
    hidden = target.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    direction = torch.randn(hidden, generator=gen)
    direction /= direction.norm()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if param.dim() == 2 and "embed" not in name:
                param.normal_(0, 0.5 / param.shape[-1] ** 0.5, generator=gen)
        embed = target.model.embed_tokens.weight
        embed.copy_(hidden ** 0.5 * direction + torch.randn(embed.shape, generator=gen))
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(2.0)
            layer.mlp.down_proj.weight.mul_(2.0)
        target.lm_head.weight.copy_(0.3 * torch.randn(target.lm_head.weight.shape, generator=gen))
        target.lm_head.weight[likely_token] = beta * direction
    layer_ids = (0, target.config.num_hidden_layers - 1)
    drafter = random_drafter(target, layer_ids=layer_ids, mask_token_id=1, seed=seed + 1)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return target, drafter


def trtspec(*args, stdin: bytes | None = None, timeout: int = 300,
            env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Run the real `trtspec` entry point in a subprocess (`env`: variables to set, or with None to unset)."""
    environment = {**os.environ, **(env or {})}
    environment = {name: value for name, value in environment.items() if value is not None}
    return subprocess.run([sys.executable, "-m", "trtspec", *map(str, args)], input=stdin,
                          capture_output=True, timeout=timeout, env=environment)


def trtspec_in_process(*args, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """Invoke the real `trtspec` command through click's CliRunner: the same command as the entry
    point, without an interpreter's start-up (~4 s here, most of a small command's time). For
    commands that need no process of their own (no stdin, signals or servers). An exception other
    than click's exit is a bug (it would have been a traceback) and is raised. `env`: variables set
    (or, with None, unset) for the call; torch's thread count is restored after it."""
    from click.testing import CliRunner

    from trtspec.cli import cli

    def set_variables(values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in env or {}}
    threads = torch.get_num_threads()
    try:
        set_variables(env or {})
        result = CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        set_variables(saved)
        torch.set_num_threads(threads)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout_bytes, result.stderr_bytes)


def exported_graphs(monkeypatch, stand_in: bytes | None = None) -> list[str]:
    """The file names of the ONNX graphs a build exports from now on (cache hits are not exports);
    with `stand_in`, an export writes those bytes instead of exporting (for tests of what a build
    does with an export, not of the export)."""
    import trtspec.build

    real, exported = trtspec.build.export_onnx, []

    def export(*args, **options):
        exported.append(args[-1].name)
        return real(*args, **options) if stand_in is None else args[-1].write_bytes(stand_in)
    monkeypatch.setattr(trtspec.build, "export_onnx", export)
    return exported


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    """A user error: exit 1, one `Error: ...` line naming every fragment, no traceback, empty stdout."""
    err = result.stderr.decode()
    assert result.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err and result.stdout == b""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]



def local_engine_of(runner, *, controller=None, policy=None, prompt_lookup: int | None = None,
                    confident_width: bool = False):
    """A local engine of one slot over `runner`: one request at a time, stepped on the caller's
    thread (what `Pipeline.generate` uses); `prompt_lookup` 0 leaves every draft to the drafter.
    Its greedy cycles are not narrowed by the drafter's confidence unless `confident_width`: that
    choice follows the machine's timing, and these engines' statistics are compared exactly."""
    from trtspec.runtime.controller import native_controller
    from trtspec.runtime.engine import EngineConfig, LocalEngine

    return LocalEngine(runner, policy, EngineConfig(max_running=1, prefill_chunk=0, prompt_lookup=prompt_lookup,
                                                    confident_width=confident_width),
                      controller=controller or native_controller)


def single(target: Qwen3Target, drafter: DFlashDrafter | None = None, *, max_context: int | None = None, **options):
    """`local_engine_of` the eager step modules of a target (and drafter)."""
    from trtspec.runtime.runner import BatchRunner

    return local_engine_of(BatchRunner.eager(target, drafter, 1, max_context=max_context), **options)


def opened(directory, device=torch.device("cpu"), **options):
    """`local_engine_of` a built engine directory."""
    from trtspec.runtime.runner import BatchRunner

    return local_engine_of(BatchRunner.open(directory, torch.device(device), **options))


def ar_of(local):
    """`local_engine_of` the same runner's graphs without the drafter (the AR baseline), caches of its own."""
    return local_engine_of(local.runner.with_slots(1, drafter=False))


def generate(local, prompt: list[int], config):
    """One request decoded to its end by `local` (a LocalEngine)."""
    return local.generate([prompt], [config])[0]


def processed_logits(logits: torch.Tensor, prompt: list[int], output: list[int], processing) -> torch.Tensor:
    """One position's logits under vLLM's processing, written out plainly (the tests' oracle):
    logit_bias, the repetition penalty over prompt and output tokens, then the frequency and
    presence penalties over output tokens (float32, as the engine)."""
    x = logits.float().clone()
    for token, bias in processing.logit_bias:
        x[token] += bias
    r = processing.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        x[token] -= processing.frequency_penalty * output.count(token)
        x[token] -= processing.presence_penalty
    return x


# -- `trtspec serve` as a real subprocess, and raw HTTP to it (tests/test_serve*.py, test_ray.py) ------

SERVED_NAME = "tiny"  # the served model's name (--served-model-name)
LONG_PROMPT = "import os\n"  # the tiny target never writes its EOS by itself: a request runs to its limit
LONG_TOKENS = 4000  # a long request's limit, near the tiny target's context (it writes them in seconds)


class Server:
    """`trtspec serve --port 0 ...` in its own session; the URL is read from its first line."""

    def __init__(self, log: Path, *args, env: dict[str, str] | None = None):
        self.log = log
        self.stream = open(log, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trtspec", "--threads", "1", "serve", "--port", "0", *map(str, args)],
            stdout=self.stream, stderr=subprocess.STDOUT, start_new_session=True,
            env=None if env is None else {**os.environ, **env})
        deadline = time.monotonic() + 120
        self.url = None
        while self.url is None:
            found = re.search(r"on http://(?:127\.0\.0\.1|0\.0\.0\.0):(\d+) ", log.read_text(errors="replace"))
            if found:  # a server on every interface is reached through loopback too
                self.url = f"http://127.0.0.1:{found.group(1)}"
            elif self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"trtspec serve did not start:\n{self.output()[-3000:]}")
            else:
                time.sleep(0.2)
        while True:
            try:
                if get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"trtspec serve never became healthy:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        import openai  # the [test] extra: the serve tests skip without it

        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # never leave a server behind
            self.process.wait(10)
            raise AssertionError(f"trtspec serve did not stop on {sig!r}:\n{self.output()[-3000:]}")
        finally:
            self.stream.close()


def get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if response.headers.get_content_type() == "text/event-stream":  # "stream": true: the events, as text
                return response.status, {"events": response.read().decode()}
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())



def pair_args(target, drafter, name: str = SERVED_NAME) -> tuple:
    """The serve options that name a pair and the model name its clients use."""
    return "--target", target, "--drafter", drafter, "--served-model-name", name


# ---- statistics of speculative sampling (T = 1): tests/test_sampling.py, and the families, draft vocabulary and
# engine tests that check the same property

SAMPLED_VOCAB, SAMPLED_PROMPT = 8, [2, 3, 4, 5]  # a predictable pair's vocabulary, and the prompt sampled from
ALPHA = 1e-3  # the level every test of a sampled distribution passes at
SAMPLED_BATCH = 64  # requests the engine decodes together


def exact_distribution(target, length: int = 3, banned: tuple[int, ...] = (),
                       prompt: list[int] = SAMPLED_PROMPT) -> np.ndarray:
    """p(t1, ..., t_length | prompt) [SAMPLED_VOCAB] * length, from the target's logits over every
    continuation of length - 1 tokens (`banned` ids removed from every position's distribution)."""
    grid = torch.cartesian_prod(*[torch.arange(SAMPLED_VOCAB)] * (length - 1)).reshape(-1, length - 1)
    sequences = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        logits = target(sequences, 0, None)[0].double()
        logits[..., list(banned)] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
    joint = probs[0, len(prompt) - 1]  # [t1]
    for k in range(1, length):  # p(t_k+1 | t1..t_k), the same for every continuation beyond t_k
        step = probs[::SAMPLED_VOCAB ** (length - 1 - k), len(prompt) + k - 1]
        step = step.reshape(*[SAMPLED_VOCAB] * (k + 1))
        joint = joint[..., None] * step
    return joint.numpy()


def exact_three_token_distribution(target) -> np.ndarray:
    return exact_distribution(target, 3)


def break_acceptance_rule(monkeypatch, rule) -> None:
    """Give the Python controller (the oracle) a broken acceptance `rule`. A broken rule may read
    posterior tokens past the first mismatch, which the engine leaves undrawn: it draws them all,
    each the target's own draw, and every request proposes greedily (the drafter's argmax, as the
    tests' premise has it: a draft accepted when it equals the target's draw, lossless under the
    right rule; sampled proposals would blur what a broken rule moves)."""
    from trtspec.runtime import engine, reference, sampling

    monkeypatch.setattr(reference, "accepted_length", rule)
    monkeypatch.setattr(engine, "DEFAULT_PROPOSAL_TEMPERATURE", 0.0)  # of every engine whose config leaves it unset
    monkeypatch.setattr(engine, "sample_requests",
                        lambda samplers, logits, drafts=None, proposals=None: sampling.sample_requests(samplers, logits))


def sample_three_tokens(pair, count: int, block_size: int = 4, controller=None, grow_to: int = 0,
                        tokens: int = 3, batched: bool = True, min_p: float = 0.0,
                        proposal_temperature: float | None = None, prompt: list[int] = SAMPLED_PROMPT,
                        prompt_lookup: int | None = None, draft_width: int | None = None, **config) -> np.ndarray:
    """First `tokens` tokens of `count` seeded requests of `prompt`, through the native controller or
    `controller`: decoded 64 at a time by the engine, or one by one by a one-slot engine
    (`batched=False`); `config`: more GenerationConfig fields."""
    from trtspec.runtime.engine import EngineConfig, LocalEngine
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.runner import BatchRunner
    from trtspec.runtime.sampling import SamplingConfig
    from trtspec.runtime.schedule import BlockChoice

    options = {"controller": controller} if controller is not None else {}
    configs = [GenerationConfig(block=BlockChoice(block_size, grow_to), max_new_tokens=tokens,
                                sampling=SamplingConfig(temperature=1.0, seed=seed, min_p=min_p), **config)
               for seed in range(count)]
    if not batched:
        one = single(*pair, **options)
        return np.array([generate(one, prompt, config).tokens for config in configs])
    local = LocalEngine(BatchRunner.eager(*pair, slots=SAMPLED_BATCH), config=EngineConfig(
        max_running=SAMPLED_BATCH, proposal_temperature=proposal_temperature, prompt_lookup=prompt_lookup,
        draft_width=draft_width), **options)
    return np.array([g.tokens for g in local.generate([prompt] * count, configs)])


def fit_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value that `samples` come from `probs`: the smaller of chi-square and the per-cell
    binomial tests (Bonferroni), doubled for taking the smaller. Cells expected below 5 counts
    are pooled."""
    from scipy.stats import binomtest, chisquare

    n = len(samples)
    counts = np.bincount(np.ravel_multi_index(samples.T, probs.shape), minlength=probs.size)
    probs = probs.ravel() / probs.sum()
    small = probs * n < 5
    counts = np.append(counts[~small], counts[small].sum())
    probs = np.append(probs[~small], probs[small].sum())
    if probs[-1] == 0:
        counts, probs = counts[:-1], probs[:-1]
    chi2 = chisquare(counts, probs * n).pvalue
    per_cell = min(binomtest(int(k), n, float(p)).pvalue for k, p in zip(counts, probs)) * len(probs)
    return min(1.0, 2 * min(chi2, per_cell))


def pvalues(samples: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    return {
        "next token (t2)": fit_pvalue(samples[:, 1:2], joint.sum(axis=(0, 2))),
        "two tokens (t2, t3)": fit_pvalue(samples[:, 1:3], joint.sum(axis=0)),
        "three tokens (t1, t2, t3)": fit_pvalue(samples, joint),
    }
