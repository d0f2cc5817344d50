"""The DFlash training recipe: block packing, train/inference agreement, learning, resuming."""

import json
import subprocess
import sys

from dataclasses import replace

import pytest
import safetensors.torch
import torch

from helpers import (TRAINED_PROMPTS, assert_one_line_error, code_prompts, generate, random_drafter, single,
                     trtspec_in_process)
from trtspec.api import Pipeline
from trtspec.errors import TrtspecError
from trtspec.models import load_drafter, load_target
from trtspec.runtime.request import GenerationConfig
from trtspec.training import trainer as trainer_module
from trtspec.training.blocks import IGNORE, pack, position_weights
from trtspec.training.data import generate_data, read_training_data
from trtspec.training.trainer import TrainConfig, new_drafter, train_drafter
from trtspec.runtime.schedule import AR, BlockChoice

def test_packing_follows_the_recipe():
    ids = list(range(10, 40))
    batch = pack([(ids, 10)], block_size=4, anchors_per_sequence=3, mask_token_id=1, gamma=7.0,
                 generator=torch.Generator().manual_seed(0))
    length, n = len(ids), 3 * 4
    assert batch.mask.shape == (1, n, length + n)
    anchors = batch.block_positions[0, ::4].tolist()
    assert all(10 <= a <= length - 2 for a in anchors) and len(set(anchors)) == 3
    for slot, anchor in enumerate(anchors):
        rows = slice(slot * 4, slot * 4 + 4)
        assert batch.block_tokens[0, rows].tolist() == [ids[anchor], 1, 1, 1]
        assert batch.block_positions[0, rows].tolist() == [anchor, anchor + 1, anchor + 2, anchor + 3]
        expected = [IGNORE] + [ids[anchor + k] if anchor + k < length else IGNORE for k in (1, 2, 3)]
        assert batch.labels[0, rows].tolist() == expected
        mask = batch.mask[0, rows]
        assert mask[:, :anchor].all() and not mask[:, anchor:length].any()   # context strictly before
        own = torch.zeros(n, dtype=torch.bool)
        own[rows] = True
        assert (mask[:, length:] == own).all()                               # own block only
    assert torch.allclose(position_weights(4, 7.0), torch.tensor([0.0, 1.0, 0.8669, 0.7515]), atol=1e-4)


def _packed_batch(target, block_size: int, anchors: int):
    """One packed batch over a random 40-token sequence, with the target's features (layers 0, 1)."""
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = pack([(ids, 12)], block_size=block_size, anchors_per_sequence=anchors, mask_token_id=1, gamma=7.0,
                 generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return batch, target(batch.tokens, 0, None, (0, 1))[1]


def test_packed_training_forward_equals_inference_forward(target_dir):
    target = load_target(target_dir)
    drafter = random_drafter(target, layers=2, layer_ids=(0, 1), mask_token_id=1)
    batch, features = _packed_batch(target, 6, 5)
    with torch.no_grad():
        packed = drafter.lm_head(drafter.forward_packed(features, batch.block_tokens, batch.block_positions,
                                                         batch.mask))
        for slot in range(5):
            anchor = int(batch.block_positions[0, slot * 6])
            block = batch.block_tokens[:, slot * 6:(slot + 1) * 6]
            alone = drafter(features[:, :anchor], block, anchor, drafter.new_cache(1, 64))
            assert (packed[:, slot * 6 + 1:(slot + 1) * 6] - alone).abs().max() < 1e-4


def test_layers_from_target_start_the_context_as_the_targets_own_keys(target_dir):
    """--layers-from-target: the drafter's layer is a copy of the target's last one, and the context
    it reads (fc passing the deepest tap, layer 0's output, through hidden_norm) gives exactly the
    keys and values the target's last layer makes from that layer's input."""
    target = load_target(target_dir)
    drafter = new_drafter(target, TrainConfig(num_layers=1, target_layer_ids=(0,), mask_token_id=1,
                                              layers_from_target=True))
    ids = torch.tensor([[5, 9, 17, 3, 30, 41]])
    with torch.no_grad():
        _, features = target(ids, 0, None, (0,))
        cos, sin = target.rotary(torch.arange(6), target.dtype)
        last = target.model.layers[1]
        theirs = last.self_attn.project_kv(last.input_layernorm(features), cos, sin)
        mine = drafter.layers[0].self_attn.project_kv(drafter.project_context(features), cos, sin)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)


def test_distillation_pulls_only_the_early_positions_toward_the_teacher(target_dir):
    from trtspec.dbloom.expand import frozen_copy
    from trtspec.training.trainer import DrafterLoss

    target = load_target(target_dir)
    drafter = random_drafter(target, layers=1, layer_ids=(0, 1), mask_token_id=1)
    batch, features = _packed_batch(target, 8, 4)
    with torch.no_grad():
        plain = DrafterLoss(drafter)(features, batch)
        # the teacher is the drafter itself: the KL term is zero
        assert DrafterLoss(drafter, frozen_copy(drafter, target), 4, block_size=8)(features, batch) == pytest.approx(plain)
        other = random_drafter(target, layers=1, layer_ids=(0, 1), mask_token_id=1, seed=7)
        assert DrafterLoss(drafter, other, 4, block_size=8)(features, batch) > plain + 1e-3
        # positions >= distill_below carry no KL: with every label there ignored but the late ones, no change
        late = torch.arange(batch.labels.shape[1]) % 8 >= 4
        batch.labels[:, ~late] = IGNORE
        assert DrafterLoss(drafter, other, 4, block_size=8)(features, batch) == pytest.approx(DrafterLoss(drafter)(features, batch))


def test_a_draft_vocabulary_loss_ranks_only_its_ids(target_dir):
    """--draft-vocab K: the loss is the cross-entropy among the K ids (labels outside them carry no
    weight); with every id in any order it is the full loss."""
    from trtspec.training.trainer import DrafterLoss

    target = load_target(target_dir)
    drafter = random_drafter(target, layers=1, layer_ids=(0, 1), mask_token_id=1)
    batch, features = _packed_batch(target, 8, 4)
    vocab = target.config.vocab_size
    with torch.no_grad():
        full = DrafterLoss(drafter)(features, batch)
        assert DrafterLoss(drafter, vocab_ids=torch.randperm(vocab))(features, batch) == pytest.approx(full)
        ids = torch.unique(batch.labels[batch.labels != IGNORE])[::2]  # half the labels fall outside
        hidden = drafter.forward_packed(features, batch.block_tokens, batch.block_positions, batch.mask)
        chosen = batch.labels != IGNORE
        inside = torch.isin(batch.labels[chosen], ids)
        logits = drafter.lm_head(hidden[chosen][inside])[:, ids]
        labels = (batch.labels[chosen][inside][:, None] == ids).float().argmax(-1)
        weights = batch.weights[chosen][inside]
        expected = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * weights).sum() / weights.sum()
        assert DrafterLoss(drafter, vocab_ids=ids)(features, batch) == pytest.approx(float(expected), rel=1e-5)


def test_soft_labels_are_the_targets_own_distributions_one_position_before(target_dir):
    """--soft-labels K: each block label's soft target is the target's top K after the position
    before it; a one-hot soft label at the response's token leaves the loss as it was, and the
    soft term is the cross-entropy against the renormalised top K (a draft vocabulary's ids only)."""
    from trtspec.training.trainer import DrafterLoss, TargetFeatures

    target = load_target(target_dir)
    drafter = random_drafter(target, layers=1, layer_ids=(0, 1), mask_token_id=1)
    batch, features = _packed_batch(target, 8, 4)
    ids = batch.tokens[0].tolist()
    kept = TargetFeatures(target, (0, 1), [(ids, 12)], autocast=False, soft_labels=5)
    assert torch.equal(kept.batch([0], len(ids)), features)
    soft_ids, soft_probs = kept.soft_batch([0], batch.block_positions)
    with torch.no_grad():
        expected = target(batch.tokens, 0, None)[0][0].softmax(-1).topk(5)
    chosen = batch.labels != IGNORE
    before = batch.block_positions[chosen] - 1  # the label at position t is predicted at t - 1
    assert torch.equal(soft_ids[chosen].long(), expected.indices[before])
    assert torch.allclose(soft_probs[chosen].float(), expected.values[before], atol=1e-3)

    with torch.no_grad():
        plain = DrafterLoss(drafter)(features, batch)
        one_hot = (batch.labels[..., None].clamp_min(0).int(), torch.ones(*batch.labels.shape, 1))
        assert DrafterLoss(drafter, soft_weight=0.7)(features, batch, one_hot) == pytest.approx(float(plain), rel=1e-5)
        vocab = torch.unique(torch.cat([batch.labels[chosen], soft_ids[chosen].flatten().long()]))
        for vocab_ids in (None, vocab):
            loss = DrafterLoss(drafter, vocab_ids=vocab_ids, soft_weight=1.0)(features, batch, (soft_ids, soft_probs))
            hidden = drafter.forward_packed(features, batch.block_tokens, batch.block_positions, batch.mask)[chosen]
            logits = drafter.lm_head(hidden) if vocab_ids is None else drafter.lm_head(hidden)[:, vocab_ids]
            log_q = logits.log_softmax(-1)
            columns = soft_ids[chosen].long()
            if vocab_ids is not None:
                columns = torch.searchsorted(vocab_ids, columns)
            probs = soft_probs[chosen].float()
            term = -(probs * log_q.gather(-1, columns)).sum(-1) / probs.sum(-1)
            weights = batch.weights[chosen]
            assert float(loss) == pytest.approx(float((term * weights).sum() / weights.sum()), rel=1e-4)


def test_soft_label_training_keeps_its_own_feature_store(tiny_data, tmp_path):
    """A run with soft labels stores each sequence's top K beside its features, in a folder of its
    own (a features-only store stays valid), and the soft term moves the weights."""
    pipeline, sequences, _ = tiny_data
    store = tmp_path / "features"
    config = TrainConfig(block_size=4, num_features=2, mask_token_id=1, steps=6, batch_size=4, anchors_per_sequence=4)
    plain = train_drafter(pipeline.target, sequences, config, tmp_path / "plain", progress=False, feature_store=store)
    soft = train_drafter(pipeline.target, sequences, replace(config, soft_labels=8), tmp_path / "soft",
                         progress=False, feature_store=store)
    folders = {frozenset(safetensors.torch.load_file(next(d.glob("*.safetensors")))) for d in store.iterdir()}
    assert folders == {frozenset({"features"}), frozenset({"features", "soft_ids", "soft_probs"})}
    weights = [load_drafter(path, pipeline.target).state_dict() for path in (plain, soft)]
    assert any(not torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    with pytest.raises(TrtspecError, match="weight in"):
        replace(config, soft_labels=8, soft_weight=1.5)


def test_a_drafter_trained_on_a_draft_vocabulary_drafts_among_it(tiny_data, target_dir, tmp_path):
    """train-drafter --draft-vocab K records K and its ids; loaded with the same data's counts the
    drafter proposes among exactly those ids by default, and counts that rank others are one line."""
    from trtspec.models.draft_vocab import ids_sha256
    from trtspec.training.trainer import response_top_ids

    pipeline, sequences, _ = tiny_data
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": pipeline.codec.decode(ids[:n]), "prompt_ids": ids[:n],
                                        "response": pipeline.codec.decode(ids[n:]), "response_ids": ids[n:]}) + "\n"
                            for ids, n in sequences[:8]))
    trained = trtspec_in_process("train-drafter", "--target", target_dir, "--data", data, "--block-size", 4,
                                 "-o", tmp_path / "d", "--steps", 3, "--batch-size", 2, "--num-features", 2,
                                 "--draft-vocab", 12)
    assert trained.returncode == 0, trained.stderr.decode()
    ids = response_top_ids(read_training_data(data, pipeline.codec), 12, pipeline.target.config.vocab_size)
    recorded = json.loads((tmp_path / "d" / "config.json").read_text())["trtspec_lineage"]["draft_vocab"]
    assert recorded == {"size": 12, "ids_sha256": ids_sha256(ids)}
    counted = trtspec_in_process("draft-vocab", "--target", target_dir, "--data", data, "-o", tmp_path / "counts")
    assert counted.returncode == 0, counted.stderr.decode()
    (tmp_path / "counts").rename(tmp_path / "d" / "draft_vocab")
    loaded = Pipeline(target_dir, tmp_path / "d")
    assert loaded.draft_vocab_size == 12 and torch.equal(loaded.draft_ids, ids)
    assert Pipeline(target_dir, tmp_path / "d", draft_vocab=20).draft_vocab_size == 20  # a flag still overrides

    other = tmp_path / "other.jsonl"
    other.write_text(data.read_text().splitlines(keepends=True)[0])
    assert trtspec_in_process("draft-vocab", "--target", target_dir, "--data", other, "-o",
                              tmp_path / "others").returncode == 0
    (tmp_path / "d" / "draft_vocab").rename(tmp_path / "kept")
    (tmp_path / "others").rename(tmp_path / "d" / "draft_vocab")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):")
    assert_one_line_error(trtspec_in_process("run", prompt, "--target", target_dir, "--drafter", tmp_path / "d",
                                             "--max-new-tokens", 4), "do not rank the 12 ids it was trained")


@pytest.fixture(scope="module")
def tiny_data(target_dir, tmp_path_factory):
    """The tiny target's own greedy continuations of random code-like prompts."""
    pipeline = Pipeline(target_dir)
    prompts = code_prompts(TRAINED_PROMPTS + 16)
    path = generate_data(pipeline, [{"prompt": p} for p in prompts[:TRAINED_PROMPTS]],
                         GenerationConfig(block=AR, max_new_tokens=64), tmp_path_factory.mktemp("data") / "train.jsonl",
                         progress=False)
    return pipeline, read_training_data(path, pipeline.codec), prompts[TRAINED_PROMPTS:]


def _mean_tau(target, drafter, codec, prompts):
    engine = single(target, drafter)
    taus = [generate(engine, codec.encode(p), GenerationConfig(block=BlockChoice(8), max_new_tokens=48)).stats.tau
            for p in prompts]
    return sum(taus) / len(taus)


@pytest.mark.slow
def test_a_trained_drafter_beats_an_untrained_one(tiny_data, tmp_path):
    pipeline, sequences, held_out = tiny_data
    mask = pipeline.codec.tokenizer.token_to_id("<|mask|>")
    # 400 steps at 6e-3: tau 2.73 on the held-out prompts (300 steps: 2.30, 200: 1.54; untrained 1.00)
    config = TrainConfig(block_size=8, num_layers=1, num_features=2, mask_token_id=mask, steps=400,
                         batch_size=8, anchors_per_sequence=8, lr=6e-3, checkpoint_every=200)
    path = train_drafter(pipeline.target, sequences, config, tmp_path / "drafter", progress=False)
    trained = load_drafter(path, pipeline.target)  # the same loader as a z-lab checkpoint
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    trained_tau = _mean_tau(pipeline.target, trained, pipeline.codec, held_out)
    untrained_tau = _mean_tau(pipeline.target, new_drafter(pipeline.target, config), pipeline.codec, held_out)
    assert trained_tau > 1.5 and trained_tau > untrained_tau + 0.4, (trained_tau, untrained_tau)


def test_training_features_skip_the_head_and_the_layers_above_the_deepest_tap(tiny_data):
    pipeline, sequences, _ = tiny_data
    target = pipeline.target
    tokens = torch.tensor([sequences[0][0][:40]])
    layers = (0,)  # the tiny target has two layers
    assert len(target.model.layers) > max(layers) + 1
    with torch.no_grad():
        expected = target(tokens, 0, None, layers)[1]
        ran: list[str] = []
        hooks = [module.register_forward_hook(lambda *_, name=name: ran.append(name))
                 for name, module in [("head", target.lm_head)] + [(f"layer {i}", layer.input_layernorm)
                                                                  for i, layer in enumerate(target.model.layers)]]
        features = target.features(tokens, layers)
        for hook in hooks:
            hook.remove()
    assert torch.equal(features, expected)
    assert ran == [f"layer {i}" for i in range(max(layers) + 1)]  # nothing above the deepest tap, no head


def test_a_feature_store_spares_a_later_run_the_target_and_changes_no_weight(tiny_data, tmp_path, monkeypatch):
    pipeline, sequences, _ = tiny_data
    config = TrainConfig(block_size=4, num_features=2, mask_token_id=1, steps=6, batch_size=4, anchors_per_sequence=4)
    plain = train_drafter(pipeline.target, sequences, config, tmp_path / "plain", progress=False)
    store = tmp_path / "features"
    first = train_drafter(pipeline.target, sequences, config, tmp_path / "first", progress=False, feature_store=store)
    stored = list(store.glob("*/*"))
    assert len(stored) == min(len(sequences), 24) and all(p.suffix == ".safetensors" for p in stored)  # 6 steps x 4

    real_decode, calls = pipeline.target.decode, []
    monkeypatch.setattr(pipeline.target, "decode", lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    again = train_drafter(pipeline.target, sequences, config, tmp_path / "again", progress=False, feature_store=store)
    assert not calls  # every sequence's features read back
    for path in (first, again):
        for (name, x), (_, y) in zip(load_drafter(plain, pipeline.target).state_dict().items(),
                                     load_drafter(path, pipeline.target).state_dict().items()):
            assert torch.equal(x, y), name


def test_interrupted_training_resumes_to_the_same_weights(tiny_data, target_dir, tmp_path, monkeypatch):
    pipeline, sequences, _ = tiny_data
    config = TrainConfig(block_size=4, num_features=2, mask_token_id=1, steps=12, batch_size=4,
                         anchors_per_sequence=4, checkpoint_every=4)
    straight = train_drafter(pipeline.target, sequences, config, tmp_path / "straight", progress=False)

    real_pack, calls = trainer_module.pack, {"n": 0}

    def crash_at_step_seven(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "pack", crash_at_step_seven)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(pipeline.target, sequences, config, tmp_path / "resumed", progress=False)
    assert not (tmp_path / "resumed").exists()  # nothing half-written looks complete
    monkeypatch.setattr(trainer_module, "pack", real_pack)
    resumed = train_drafter(pipeline.target, sequences, config, tmp_path / "resumed", progress=False)
    a, b = load_drafter(straight, pipeline.target), load_drafter(resumed, pipeline.target)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name

    with pytest.raises(TrtspecError, match=r"another training run: steps \(checkpoint 12, now 13\); batch_size"):
        train_drafter(pipeline.target, sequences, TrainConfig(block_size=4, num_features=2, mask_token_id=1,
                                                              steps=13), tmp_path / "resumed", progress=False)
    with pytest.raises(TrtspecError, match=r"another training run: the training data \(--data\) differ"):
        train_drafter(pipeline.target, sequences[1:], config, tmp_path / "resumed", progress=False)
    other_target = load_target(target_dir)
    with torch.no_grad():
        other_target.model.norm.weight.add_(1.0)
    with pytest.raises(TrtspecError, match=r"another training run: the target \(--target\) differ"):
        train_drafter(other_target, sequences, config, tmp_path / "resumed", progress=False)
    checkpoint = tmp_path / "resumed.work" / "checkpoint.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:5000])  # a checkpoint cut short (disk full, killed copy)
    with pytest.raises(TrtspecError, match="cannot read the training checkpoint .*truncated"):
        train_drafter(pipeline.target, sequences, config, tmp_path / "resumed", progress=False)


def test_a_checkpoint_older_than_an_option_resumes_while_the_option_keeps_its_default(tiny_data, tmp_path):
    pipeline, sequences, _ = tiny_data
    config = TrainConfig(block_size=4, num_features=2, mask_token_id=1, steps=2, batch_size=4, anchors_per_sequence=4)
    train_drafter(pipeline.target, sequences, config, tmp_path / "first", progress=False)
    checkpoint = tmp_path / "first.work" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False)
    for newer in ("soft_labels", "soft_weight"):  # as a checkpoint written before these options existed
        del state["config"][newer]
    torch.save(state, checkpoint)
    assert train_drafter(pipeline.target, sequences, config, tmp_path / "again", tmp_path / "first.work",
                         progress=False).is_dir()
    with pytest.raises(TrtspecError, match=r"soft_labels option \(not in the checkpoint\)"):
        train_drafter(pipeline.target, sequences, replace(config, soft_labels=8), tmp_path / "other",
                      tmp_path / "first.work", progress=False)


def test_the_training_commands_turn_prompts_into_a_drafter(target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):"}) + "\n" for i in range(6)))
    data = tmp_path / "train.jsonl"

    trtspec = trtspec_in_process  # the entry point's own subprocess: the DDP test below, test_inputs.py
    made = trtspec("generate-data", "--target", target_dir, "--prompts", prompts, "-o", data, "--max-new-tokens", 24)
    assert made.returncode == 0, made.stderr.decode()
    records = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(records) == 6 and all(len(r["response_ids"]) >= 1 for r in records)
    trained = trtspec("train-drafter", "--target", target_dir, "--data", data, "--block-size", 4, "-o",
                      tmp_path / "d", "--steps", 5, "--batch-size", 2, "--num-features", 2)
    assert trained.returncode == 0, trained.stderr.decode()
    assert json.loads((tmp_path / "d" / "config.json").read_text())["block_size"] == 4
    bad = trtspec("train-drafter", "--target", target_dir, "--data", tmp_path / "nope.jsonl", "--block-size", 4,
                  "--num-features", 2, "-o", tmp_path / "e")
    assert bad.returncode == 1 and b"file not found" in bad.stderr and b"Traceback" not in bad.stderr


def test_batched_continuations_equal_single_request_decoding(target_dir):
    pipeline = Pipeline(target_dir)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15], [5, 6, 7, 8]]
    stop = pipeline.codec.stop_ids
    config = GenerationConfig(block=AR, max_new_tokens=20, stop_ids=stop)
    from trtspec.training.data import continue_prompts
    batched = continue_prompts(pipeline, prompts, config, batch_size=3, progress=False)
    for prompt, row in zip(prompts, batched):
        assert row == pipeline.local_engine.generate([prompt], [config])[0].tokens


def test_train_drafter_runs_under_torchrun_with_ddp(target_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": "    return x + 1\n" * 3}) + "\n"
                            for i in range(8)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "trtspec", "--threads", "1", "train-drafter", "--target", str(target_dir), "--data", str(data),
               "--block-size", "4", "--num-features", "2", "--steps", "3", "--batch-size", "2",
               "-o", str(tmp_path / "ddp")]
    result = subprocess.run(command, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert load_drafter(tmp_path / "ddp", load_target(target_dir)).config.block_size == 4


def test_duplicate_or_excess_taps_are_refused_at_the_door(target_dir, tmp_path):
    """`--num-features 99` on a 2-layer target tapped layer 1 ninety-nine times, and explicit ids
    could repeat a layer: both are one line now, before the data is read (it does not exist here).
    DFlash's spread, where it would repeat a layer on a shallow target, spreads over all layers."""
    from helpers import assert_one_line_error, trtspec_in_process

    from trtspec.models import default_target_layer_ids

    common = ("train-drafter", "--target", target_dir, "--data", tmp_path / "missing.jsonl", "--block-size", 4,
              "--steps", 1, "-o", tmp_path / "d")
    assert_one_line_error(trtspec_in_process(*common, "--num-features", 99), "--num-features 99",
                          "target's 2 layers")
    assert_one_line_error(trtspec_in_process(*common, "--target-layer-ids", "1,0,1"), "layer 1 more than once")
    assert_one_line_error(trtspec_in_process(*common, "--target-layer-ids", "0,2"), "--target-layer-ids 2",
                          "2-layer target")
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # DFlash's spread where it fits
    assert default_target_layer_ids(4, 2) == [0, 3] and default_target_layer_ids(6, 5) == [0, 1, 2, 4, 5]
    assert default_target_layer_ids(4, 4) == [0, 1, 2, 3]
