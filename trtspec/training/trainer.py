"""The DFlash training loop: frozen target, its features kept per sequence, packed blocks, weighted loss.

Runs on one CPU for small drafters and under `torchrun` with DistributedDataParallel at scale
(each rank trains on its own share of the sequences). Checkpoints are written atomically every
few steps to a work directory and training resumes from there when restarted.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from trtspec import validate
from trtspec.errors import TrtspecError
from trtspec.fileio import key_digest, staged_file
from trtspec.limits import SEED, check_block_size
from trtspec.models import DFlashConfig, DFlashDrafter, Qwen3Target, default_target_layer_ids, save_drafter
from trtspec.models.config import check_target_layer_ids
from trtspec.models.draft_vocab import TokenCounts, ids_sha256
from trtspec.training.draft_vocab import response_counts
from trtspec.training.blocks import IGNORE, PackedBatch, cosine_with_warmup, default_gamma, pack


@dataclass(frozen=True)
class TrainConfig:
    block_size: int = 16
    num_layers: int = 1
    num_features: int = 3                       # target layers tapped, when target_layer_ids is not given
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = -1                     # -1: ask the caller (the tokenizer's <|mask|>)
    steps: int = 1000
    batch_size: int = 8
    anchors_per_sequence: int = 32
    max_length: int = 512
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_fraction: float = 0.04
    clip_norm: float = 1.0
    gamma: float = 0.0                          # 0: the paper's value for this block size
    seed: int = 0
    checkpoint_every: int = 100
    position_weight_shift: int = 0              # >0 moves loss weight toward positions >= shift (expand-block)
    distill_below: int = 0                      # >0: positions < this also match a frozen teacher (expand-block)
    distill_weight: float = 1.0                 # weight of that KL term against the cross-entropy
    bfloat16_autocast: bool = False             # forward passes in bfloat16, float32 weights and optimizer
    layers_from_target: bool = False            # start the drafter's layers as copies of the target's last ones
    draft_vocab: int = 0                        # >0: the loss ranks only the K most frequent response ids (FR-Spec)
    soft_labels: int = 0                        # >0: also learn the target's own next-token distribution (its top K)
    soft_weight: float = 0.5                    # that term's share of each position's loss
    lineage: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        SEED.check(self.seed)
        for name in ("num_layers", "steps", "batch_size", "anchors_per_sequence", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise TrtspecError(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 4:
            raise TrtspecError(f"max length must be >= 4, got {self.max_length}")
        if not self.lr > 0:
            raise TrtspecError(f"learning rate must be > 0, got {self.lr}")
        if self.soft_labels < 0 or not 0 <= self.soft_weight <= 1:
            raise TrtspecError(f"soft labels need K >= 0 and a weight in [0, 1], got {self.soft_labels} and "
                               f"{self.soft_weight}")

    @property
    def decay(self) -> float:
        return self.gamma or default_gamma(self.block_size)


class DrafterLoss(nn.Module):
    """The weighted block cross-entropy, as a module so DDP can wrap it (the target stays outside).

    With a `teacher` (expand-block), block positions below `distill_below` also pay the KL
    divergence from the teacher's predictions on the same blocks: the drafter learns its new,
    later positions without giving up the early ones it was already good at.

    With `soft` labels (the target's K likeliest next tokens and their probabilities at each
    position), a `soft_weight` share of each position's loss is the cross-entropy against that
    distribution rather than the one token the response holds: a sampled request accepts a draft
    drawn from q with probability sum min(p, q), so q should learn the target's spread, which a
    greedy response (most of the data) does not show.
    """

    def __init__(self, drafter: DFlashDrafter, teacher: DFlashDrafter | None = None, distill_below: int = 0,
                 distill_weight: float = 1.0, block_size: int = 0, vocab_ids: torch.Tensor | None = None,
                 soft_weight: float = 0.0):
        super().__init__()
        if distill_below and teacher is None:
            raise TrtspecError("distilling early positions needs a teacher drafter")
        self.drafter, self.distill_below, self.distill_weight = drafter, distill_below, distill_weight
        self.soft_weight = soft_weight
        self.block_size = block_size
        self.teacher = [teacher]  # in a list: frozen, not a submodule (no gradients, not in DDP's buckets)
        # A draft vocabulary: logits over its K ids only (the head's other rows never computed, the
        # step's largest cost), each label mapped to its index among them, labels outside ignored.
        # The head is the target's, frozen and shared with the teacher: its K rows are cut once.
        index = head = None
        if vocab_ids is not None:
            index = torch.full((drafter.config.vocab_size,), IGNORE, dtype=torch.long, device=vocab_ids.device)
            index[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
            head = drafter.lm_head.weight.detach()[vocab_ids]
        self.register_buffer("label_index", index, persistent=False)
        self.register_buffer("vocab_head", head, persistent=False)

    def _logits(self, drafter: DFlashDrafter, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, drafter.lm_head.weight if self.vocab_head is None else self.vocab_head).float()

    def forward(self, features: torch.Tensor, batch: PackedBatch,
                soft: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The batch's loss; `soft`: the target's distribution of each block position's label, as
        (ids, probabilities) [b, N, K] (TargetFeatures.soft_batch)."""
        hidden = self.drafter.forward_packed(features, batch.block_tokens, batch.block_positions, batch.mask)
        chosen = batch.labels != IGNORE
        labels = batch.labels[chosen]
        if self.label_index is not None:
            labels = self.label_index[labels]
        logits = self._logits(self.drafter, hidden[chosen])
        losses = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE)
        if soft is not None and self.soft_weight:
            taught = self._soft_loss(logits, *(t[chosen] for t in soft))
            losses = (1 - self.soft_weight) * losses + self.soft_weight * taught
        if self.distill_below:
            teacher = self.teacher[0]
            offsets = torch.arange(batch.labels.shape[1], device=logits.device) % self.block_size
            early = (offsets < self.distill_below).expand_as(chosen)[chosen]
            with torch.no_grad():
                taught = teacher.forward_packed(features, batch.block_tokens, batch.block_positions, batch.mask)
                reference = self._logits(teacher, taught[chosen]).log_softmax(dim=-1)
            divergence = F.kl_div(logits.log_softmax(dim=-1), reference, log_target=True, reduction="none").sum(-1)
            losses = losses + self.distill_weight * divergence * early
        weights = batch.weights[chosen] * (labels != IGNORE)
        return (losses * weights).sum() / weights.sum().clamp_min(1e-6)

    def _soft_loss(self, logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the drafter's logits [M, V'] against the target's top-K [M, K], renormalised
        over the ids the drafter can propose (a draft vocabulary drops the rest)."""
        ids = ids.long()
        if self.label_index is not None:
            ids = self.label_index[ids]
        probs = probs.float() * (ids != IGNORE)
        log_q = logits.log_softmax(dim=-1).gather(-1, ids.clamp_min(0))
        return -(probs * log_q).sum(-1) / probs.sum(-1).clamp_min(1e-6)


def _feature_bytes() -> int:
    """Target features kept in memory across epochs, at most (beyond: computed again every epoch): a
    third of the machine's memory, up to 16 GiB (the default pair's 3,600 sequences take 3 GiB)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows)
        memory = 12 << 30
    return min(16 << 30, memory // 3)


FEATURE_BYTES = _feature_bytes()


class TargetFeatures:
    """The frozen target's features of each training sequence, computed alone (so a sequence's
    features never depend on its batch, and a resumed run sees the same numbers) at its first batch
    and kept within FEATURE_BYTES: after the first epoch a step runs no target forward pass.

    With `soft_labels` K the same pass also keeps, after every position, the target's K likeliest
    next tokens and their probabilities (the whole stack and the LM head then run).

    With a `store` directory they are also written there, a safetensors file per sequence (named by
    its token ids) in a folder named by the target's weights, taps, dtype and K: a later run over the
    same sequences (the next run of a recipe, on more shards) reads them instead of running the
    target (most of a first epoch's time), and a data set beyond FEATURE_BYTES is read back rather
    than computed again every epoch."""

    def __init__(self, target: Qwen3Target, layer_ids: tuple[int, ...], sequences: list, autocast: bool,
                 store: str | Path | None = None, soft_labels: int = 0):
        self.target, self.layer_ids, self.sequences, self.autocast = target, tuple(layer_ids), sequences, autocast
        self.soft_labels = soft_labels
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.kept_bytes = 0
        self.store = None
        if store is not None:
            key = {"target": target_fingerprint(target), "layers": list(self.layer_ids), "autocast": autocast,
                   "torch": torch.__version__}
            if soft_labels:  # stores of features alone keep their name
                key["soft_labels"] = soft_labels
            self.store = Path(store) / key_digest(key, 16)
            self.store.mkdir(parents=True, exist_ok=True)

    def _of(self, index: int) -> dict[str, torch.Tensor]:
        """Sequence `index`'s features [length, F] (and soft_ids, soft_probs [length, K])."""
        kept = self.kept.get(index)
        if kept is not None:
            return kept
        ids = self.sequences[index][0]
        stored = self.store / f"{_fingerprint(json.dumps(ids).encode())[:32]}.safetensors" if self.store else None
        if stored is not None and stored.is_file():
            kept = safetensors.torch.load_file(stored, device=str(self.target.device))
        else:
            kept = self._compute(torch.tensor([ids], device=self.target.device))
            if stored is not None:  # written beside, then renamed: a run cut off leaves no half file
                partial = stored.with_name(f".{stored.name}.{os.getpid()}")
                safetensors.torch.save_file({name: t.contiguous().cpu() for name, t in kept.items()}, partial)
                os.replace(partial, stored)
        size = sum(t.numel() * t.element_size() for t in kept.values())
        if self.kept_bytes + size <= FEATURE_BYTES:
            self.kept[index], self.kept_bytes = kept, self.kept_bytes + size
        return kept

    def _compute(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad(), torch.autocast(self.target.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            if not self.soft_labels:
                return {"features": self.target.features(tokens, self.layer_ids)[0]}
            features, logits = self.target.features_and_logits(tokens, self.layer_ids)
        probs, ids = logits[0].float().softmax(dim=-1).topk(self.soft_labels, dim=-1)
        return {"features": features[0], "soft_ids": ids.int(), "soft_probs": probs.half()}

    def of(self, index: int) -> torch.Tensor:
        """[length, F] for sequence `index`."""
        return self._of(index)["features"]

    def batch(self, indices: list[int], length: int) -> torch.Tensor:
        """[b, length, F]: the sequences' features, zero-padded at the end as pack() pads the tokens."""
        rows = [self.of(i) for i in indices]
        out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
        for row, features in enumerate(rows):
            out[row, :features.shape[0]] = features
        return out

    def soft_batch(self, indices: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distribution of the token at each of `positions` [b, N] (a block's labels:
        its prediction one position before), as (ids, probabilities) [b, N, K]."""
        rows = [self._of(i) for i in indices]
        before = [(where - 1).clamp(0, len(row["soft_ids"]) - 1) for row, where in zip(rows, positions)]
        ids, probs = (torch.stack([row[name][at] for row, at in zip(rows, before)]) for name in ("soft_ids", "soft_probs"))
        return ids, probs


def response_top_ids(sequences: list[tuple[list[int], int]], k: int, vocab_size: int) -> torch.Tensor:
    """The K most frequent response token ids of the data, as `trtspec draft-vocab --data` over the
    same file ranks them (the shipped counts then select exactly the ids the drafter trained on)."""
    return TokenCounts(response_counts(sequences, vocab_size)).top_ids(k)


def tapped_layers(config: TrainConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target layers a new drafter taps (given, or DFlash's default spread), each a layer of the
    target and none twice; a one-line TrtspecError otherwise."""
    layer_ids = config.target_layer_ids or tuple(default_target_layer_ids(num_target_layers, config.num_features))
    check_target_layer_ids(layer_ids, num_target_layers)
    return tuple(layer_ids)


def new_drafter(target: Qwen3Target, config: TrainConfig) -> DFlashDrafter:
    """A freshly initialised drafter shaped after the target (hidden size, heads, vocabulary)."""
    t = target.config
    layer_ids = tapped_layers(config, t.num_hidden_layers)
    drafter_config = DFlashConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings,
        block_size=config.block_size, mask_token_id=config.mask_token_id, target_layer_ids=layer_ids,
        num_target_layers=t.num_hidden_layers, lineage=dict(config.lineage))
    generator = torch.Generator().manual_seed(config.seed)
    drafter = DFlashDrafter(drafter_config)
    with torch.no_grad():
        for param in drafter.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02, generator=generator)
        if config.layers_from_target:
            copy_target_layers(drafter, target)
    return drafter.to(device=target.device, dtype=target.dtype).bind(target)


def copy_target_layers(drafter: DFlashDrafter, target: Qwen3Target) -> None:
    """Start the drafter from the top of the target: its n layers are copies of the target's last n
    and its final norm is the target's, `fc` passes the deepest tapped layer's features through
    (the others start at zero) and `hidden_norm` is the first copied layer's input norm, so at
    the start every context position's keys and values in the first layer are the target's own.
    A drafter trained on a CPU budget learns from there far faster than from random weights."""
    layers, hidden = len(drafter.layers), drafter.config.hidden_size
    first = target.config.num_hidden_layers - layers
    for mine, theirs in zip(drafter.layers, target.model.layers[first:]):
        own = mine.state_dict()
        mine.load_state_dict({name: tensor for name, tensor in theirs.state_dict().items() if name in own},
                             strict=False)
    drafter.norm.load_state_dict(target.model.norm.state_dict())
    drafter.hidden_norm.load_state_dict(target.model.layers[first].input_layernorm.state_dict())
    deepest = max(range(len(drafter.config.target_layer_ids)), key=lambda i: drafter.config.target_layer_ids[i])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden:(deepest + 1) * hidden] = torch.eye(hidden)


def _distributed() -> tuple[int, int]:
    """(rank, world size); initialises torch.distributed when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend)
    return int(os.environ.get("RANK", "0")), world


CHECKPOINT_KEYS = ("config", "step", "drafter", "optimizer", "schedule", "generator", "order")
CHECKPOINT_FILE = "checkpoint.pt"


def _fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weights_fingerprint(module: nn.Module, described: dict | None = None) -> str:
    """A cheap digest of a module's weights (per tensor its shape, sum and first values) and of
    `described` (its config, where that matters)."""
    digest = hashlib.sha256(json.dumps(described or {}, sort_keys=True).encode())
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            flat = tensor.detach().reshape(-1)
            summary = [float(flat.sum(dtype=torch.float64))] + flat[:16].double().tolist()
            digest.update(f"{name}{tuple(tensor.shape)}{summary}".encode())
    return digest.hexdigest()


def target_fingerprint(target: Qwen3Target) -> str:
    """A cheap digest of the frozen target: its config and weights."""
    return weights_fingerprint(target, target.config.to_dict())


RUN_INPUTS = {"data": "the training data (--data)", "target": "the target (--target)",
              "init": "the starting drafter (--init-from, or the drafter expand-block expands)"}


def _run_inputs(target: Qwen3Target, sequences: list, drafter: DFlashDrafter | None) -> dict:
    """What a run trains from besides its options (`RUN_INPUTS`), as digests kept in its checkpoints."""
    return {"data": _fingerprint(json.dumps(sequences).encode()), "target": target_fingerprint(target),
            "init": weights_fingerprint(drafter) if drafter is not None else None}


def _check_resume(path: Path, state: dict, config: dict, run: dict) -> None:
    """Refuse to resume a checkpoint made with other data, another target or starting drafter, or
    other options, naming what differs (a silent resume would continue someone else's run)."""
    differ = [f"{key} (checkpoint {state['config'][key]!r}, now {value!r})"
              for key, value in config.items() if key in state["config"] and state["config"][key] != value]
    defaults = json.loads(json.dumps(asdict(TrainConfig())))  # an option newer than the checkpoint, left at its default
    differ += [f"{key} option (not in the checkpoint)" for key, value in config.items()
               if key not in state["config"] and (key not in defaults or value != defaults[key])]
    # checkpoints written before the data, target and starting drafter were recorded are resumed as before
    differ += [RUN_INPUTS[key] for key, value in run.items() if state.get(key, value) != value]
    if differ:
        raise TrtspecError(f"{path} was written by another training run: {'; '.join(differ)} differ; "
                           "resume with the same arguments, or delete it or pass another --work directory")


def work_directory(output: str | Path, work_dir: str | Path | None = None) -> Path:
    """Where a run keeps the checkpoints it resumes from: `work_dir`, or OUTPUT.work beside the output."""
    return Path(work_dir) if work_dir else Path(str(output).rstrip("/") + ".work")


def _usable(sequences: list[tuple[list[int], int]], config: TrainConfig) -> list[tuple[list[int], int]]:
    """The sequences cut to max length that keep at least two response tokens to predict."""
    usable = [(ids[:config.max_length], prompt_len) for ids, prompt_len in sequences
              if min(len(ids), config.max_length) - prompt_len >= 2]
    if not usable:
        raise TrtspecError("no training sequence has at least two response tokens within max length")
    return usable


def finished_checkpoint(target: Qwen3Target, sequences: list[tuple[list[int], int]], config: TrainConfig,
                        output: str | Path, work_dir: str | Path | None = None,
                        drafter: DFlashDrafter | None = None) -> dict | None:
    """The checkpoint of a finished run of exactly these inputs and options in the work
    directory, or None where there is none or it is unfinished; one of another run is refused
    as `train_drafter` refuses to resume it."""
    path = work_directory(output, work_dir) / CHECKPOINT_FILE
    if not path.exists():
        return None
    state = validate.training_checkpoint(path, CHECKPOINT_KEYS)
    _check_resume(path, state, json.loads(json.dumps(asdict(config))),
                  _run_inputs(target, _usable(sequences, config), drafter))
    return state if state["step"] >= config.steps else None


def _atomic_save(state: dict, path: Path) -> None:
    with staged_file(path) as temporary:
        torch.save(state, temporary)


def train_drafter(target: Qwen3Target, sequences: list[tuple[list[int], int]], config: TrainConfig,
                  output: str | Path, work_dir: str | Path | None = None,
                  drafter: DFlashDrafter | None = None, teacher: DFlashDrafter | None = None,
                  progress: bool = True, feature_store: str | Path | None = None) -> Path:
    """Train (or continue training `drafter`) and write it in the z-lab layout to `output`.

    `sequences` are (token ids, prompt length) pairs; anchors are drawn among response tokens.
    `teacher` (frozen) is what positions below `config.distill_below` are kept close to.
    `feature_store`: where the target's features of each sequence are kept for later runs (TargetFeatures).
    """
    if config.mask_token_id < 0 and drafter is None:
        raise TrtspecError("no mask token id: the tokenizer has no <|mask|> token; pass --mask-token-id")
    vocab_ids = response_top_ids(sequences, config.draft_vocab, target.config.vocab_size) \
        if config.draft_vocab else None
    sequences = _usable(sequences, config)
    run = _run_inputs(target, sequences, drafter)  # before training changes the starting drafter
    rank, world = _distributed()
    for param in target.parameters():
        param.requires_grad_(False)
    target.eval()
    if drafter is None:
        drafter = new_drafter(target, config)
    if config.bfloat16_autocast:  # the frozen target in bfloat16 (no weight casts per step); the drafter trains in float32
        target.to(torch.bfloat16)
        drafter.float()
    drafter.train()
    loss_module: nn.Module = DrafterLoss(drafter, teacher, config.distill_below, config.distill_weight,
                                         config.block_size, vocab_ids, config.soft_weight if config.soft_labels else 0)
    if world > 1:
        loss_module = nn.parallel.DistributedDataParallel(loss_module)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    warmup = max(1, round(config.warmup_fraction * config.steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: cosine_with_warmup(s, config.steps, warmup))
    generator = torch.Generator().manual_seed(config.seed + rank)
    work = work_directory(output, work_dir)
    checkpoint_path = work / CHECKPOINT_FILE
    recorded = json.loads(json.dumps(asdict(config)))
    step, order = 0, []  # order: the rest of this epoch's shuffled sequence indices
    if checkpoint_path.exists():
        state = validate.training_checkpoint(checkpoint_path, CHECKPOINT_KEYS)
        _check_resume(checkpoint_path, state, recorded, run)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        generator.set_state(state["generator"])
        step, order = state["step"], state["order"]
    work.mkdir(parents=True, exist_ok=True)

    my_sequences = sequences[rank::world]
    kept = TargetFeatures(target, drafter.config.target_layer_ids, my_sequences, config.bfloat16_autocast,
                          feature_store, config.soft_labels)
    bar = tqdm(total=config.steps, initial=step, disable=not progress or rank != 0, unit="step",
               dynamic_ncols=True, desc="train-drafter")
    while step < config.steps:
        began = time.perf_counter()
        if len(order) < config.batch_size:  # a new epoch: reshuffle (anchors are resampled every batch)
            order += torch.randperm(len(my_sequences), generator=generator).tolist()
        chosen, order = order[:config.batch_size], order[config.batch_size:]
        batch = pack([my_sequences[i] for i in chosen], config.block_size, config.anchors_per_sequence,
                     drafter.config.mask_token_id, config.decay, generator,
                     emphasis_from=config.position_weight_shift)
        batch = PackedBatch(*(t.to(target.device) for t in vars(batch).values()))
        soft = kept.soft_batch(chosen, batch.block_positions) if config.soft_labels else None
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=config.bfloat16_autocast):
            features = kept.batch(chosen, batch.tokens.shape[1])
            loss = loss_module(features, batch, soft)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), config.clip_norm)
        optimizer.step()
        schedule.step()
        step += 1
        rate = batch.predicted_tokens / (time.perf_counter() - began)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{rate:.0f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
        bar.update(1)
        if rank == 0 and (step % config.checkpoint_every == 0 or step == config.steps):
            _atomic_save({"config": recorded, **run, "step": step, "drafter": drafter.state_dict(),
                          "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                          "generator": generator.get_state(), "order": order}, checkpoint_path)
    bar.close()
    drafter.eval()
    if vocab_ids is not None:  # inference drafts among the same K ids by default (Pipeline, build)
        drafter.config = replace(drafter.config, lineage={
            **drafter.config.lineage, "draft_vocab": {"size": config.draft_vocab, "ids_sha256": ids_sha256(vocab_ids)}})
    if rank == 0:
        save_drafter(drafter, output)
    if world > 1:
        torch.distributed.barrier()
    return Path(output)
