"""Drafter training on a tiny random target: block mask, train/inference agreement, one step, export, resume."""
from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch
from helpers import tiny_target

from drafting.dflash import load_dflash
from engine.forward import TargetForward
from training.features import teacher_forced
from training.generate import decode_many
from training.shards import Sequence, write_shard
import training.train_loop as train_loop_mod
from training.train import DrafterTrainer, TrainConfig, block_attention_mask, frequent_vocab, make_batch, to_drafter
from training.train_loop import (TokenData, build, choose_autocast, export, load_state, save_ckpt, save_state, train_stage, train_step,
                                 validate)

LAYERS = (0, 1)  # target_layer_ids of the tiny 2-layer target


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=16, seed=3)


def greedy_records(target, n_prompts: int = 6, max_new: int = 24, seed: int = 0) -> list[dict]:
    """Greedy responses of the tiny target to random prompts, with their teacher-forced features."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 16, (int(n),), generator=gen).tolist() for n in (3, 5, 4, 6, 2, 5)[:n_prompts]]
    fw = TargetForward(target.model, packed=False)
    outs = decode_many(fw, prompts, max_new, set(), slots=4)
    seqs = [(torch.tensor(p + d.response).numpy(), len(p)) for p, d in zip(prompts, outs)]
    return [{"ids": torch.from_numpy(ids).int(), "prompt_len": pl, **f}
            for (ids, pl), f in zip(seqs, teacher_forced(fw, seqs, tuple(i + 1 for i in LAYERS), 4, max_rows=40))]


@pytest.fixture(scope="module")
def records(target):
    return greedy_records(target)


def cfg_for(**kw) -> TrainConfig:
    base = dict(block_size=4, num_layers=1, intermediate_size=64, target_layer_ids=LAYERS, mask_token_id=15,
                draft_vocab=0, blocks=5, batch=4, lr=3e-3, steps=10, warmup=0.0, soft_weight=0.5)
    base.update(kw)
    return TrainConfig(**base)


def test_generated_data_is_greedy_and_features_equal_a_transformers_forward(target, records):
    """Batched decoding gives each prompt's own greedy tokens; the teacher-forced features and top-k
    equal transformers' hidden states and logits over the finished sequence."""
    m = target.model
    assert len(records) == 6 and all(len(r["ids"]) - r["prompt_len"] == 24 for r in records)
    for r in records:
        ids = r["ids"].long()[None]
        out = m(input_ids=ids, output_hidden_states=True)
        pl = r["prompt_len"]
        assert torch.equal(out.logits[0, pl - 1:-1].argmax(-1), ids[0, pl:])
        want = torch.cat([out.hidden_states[i + 1][0, :-1] for i in LAYERS], -1)
        torch.testing.assert_close(r["features"].float(), want, atol=2e-2, rtol=2e-2)
        assert r["top_ids"].shape == (ids.shape[1] - pl, 4)
        assert torch.equal(r["top_ids"][:, 0].long(), ids[0, pl:])
        lp = torch.log_softmax(out.logits[0, pl - 1:-1].float(), -1).gather(1, r["top_ids"].long())
        torch.testing.assert_close(r["top_lp"].float(), lp, atol=2e-2, rtol=1e-2)


def test_block_mask_follows_recipe():
    """Block j sees context strictly before its anchor and its own block, never another block."""
    B, T = 4, 12
    anchors = torch.tensor([[3, 7, 9]])
    mask = block_attention_mask(anchors, T, B)[0, 0]
    assert mask.shape == (3 * B, T + 3 * B)
    for q in range(3 * B):
        j = q // B
        for c in range(T):
            assert bool(mask[q, c]) == (c < int(anchors[0, j]))
        for k in range(3 * B):
            assert bool(mask[q, T + k]) == (k // B == j)


@pytest.mark.parametrize("inject,vocab", [(False, 0), (True, 10)])
def test_training_forward_equals_inference_propose(target, records, inject, vocab):
    """Each block of the one-pass masked training forward scores exactly what DFlashDrafter.propose
    scores for that anchor at inference (context = tokens before the anchor, root = anchor token)."""
    cfg = cfg_for(inject_anchor=inject, draft_vocab=vocab, soft_weight=0.0)
    d2t = frequent_vocab(records, 16, vocab) if vocab else None
    tr = DrafterTrainer(target.model, cfg, d2t).eval()
    batch = make_batch(records[:2], cfg, torch.Generator().manual_seed(1), soft=False)
    # Recompute the training logits of every block.
    captured = {}
    orig = torch.nn.functional.linear

    def spy(x, w, *a):
        y = orig(x, w, *a)
        if w is tr.head_w:
            captured["logits"] = y
        return y

    torch.nn.functional.linear = spy
    try:
        with torch.no_grad():
            tr(batch)
    finally:
        torch.nn.functional.linear = orig
    logits = captured["logits"]  # [b, nb, B-1, Vd]
    drafter = to_drafter(tr, target.model)
    for i in range(2):
        for j in range(cfg.blocks):
            a = int(batch["anchors"][i, j])
            st = drafter.new_state()
            drafter.extend(st, batch["ids"][i, :a].tolist(), batch["features"][i, :a].float())
            drafter.propose(st, int(batch["ids"][i, a]), cfg.block_size - 1)
            # propose keeps top-k only; recompute its full logits from its state the same way.
            st2 = drafter.new_state()
            drafter.extend(st2, batch["ids"][i, :a].tolist(), batch["features"][i, :a].float())
            h = _propose_hidden(drafter, st2, int(batch["ids"][i, a]))
            want = torch.nn.functional.linear(h, drafter._head_w)
            torch.testing.assert_close(logits[i, j], want, atol=1e-4, rtol=1e-4)


def _propose_hidden(drafter, state, root):
    """The final-normed block states at positions 1..B-1 that propose() feeds to the lm_head."""
    m = drafter.model
    feats = torch.cat(state.pending, 0)[None]
    ctx = m.context_features(feats)
    n = feats.shape[1]
    B = drafter.block_size
    ids = torch.full((1, B), drafter.spec.mask_token_id)
    ids[0, 0] = root
    x = drafter.embed(ids)
    if drafter.spec.inject_anchor:
        x = x + ctx[:, -1:]
    h, _ = m.forward_block(x, torch.arange(n, n + B)[None], ctx, torch.arange(n)[None], None)
    return h[0, 1:]


def test_one_training_step_lowers_the_loss(target, records):
    cfg = cfg_for(draft_vocab=12, inject_anchor=True)
    d2t = frequent_vocab(records, 16, 12)
    tr = DrafterTrainer(target.model, cfg, d2t)
    opt = torch.optim.AdamW(tr.model.parameters(), lr=cfg.lr)
    batch = make_batch(records[:4], cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = float(tr(batch)["loss"])
    m = train_step(tr, opt, batch, 0)
    assert m["loss"] == pytest.approx(before, rel=0.05)  # bf16 autocast vs float32
    with torch.no_grad():
        after = float(tr(batch)["loss"])
    assert after < before


def test_autocast_is_chosen_by_timing_both_and_leaves_the_weights_alone(target, records):
    cfg = cfg_for(draft_vocab=12, inject_anchor=True)
    tr = DrafterTrainer(target.model, cfg, frequent_vocab(records, 16, 12))
    batch = make_batch(records[:4], cfg, torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    on, timed = choose_autocast(tr, batch, "auto")
    assert set(timed) == {"bf16_s", "fp32_s"} and min(timed.values()) > 0
    assert on == (timed["bf16_s"] < timed["fp32_s"])
    # a resumed run keeps its mode unless the other one is clearly faster
    tl_margin = 1 - train_loop_mod.AUTOCAST_MARGIN
    kept, t2 = choose_autocast(tr, batch, "auto", current=not on)
    loser, winner = (t2["fp32_s"], t2["bf16_s"]) if on else (t2["bf16_s"], t2["fp32_s"])
    assert kept == (not on if winner > tl_margin * loser else on)
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert all(p.grad is None for p in tr.model.parameters())
    assert choose_autocast(tr, batch, "on") == (True, {}) and choose_autocast(tr, batch, "off") == (False, {})
    with pytest.raises(ValueError, match="auto, on or off"):
        choose_autocast(tr, batch, "bf16")


def test_export_reloads_with_identical_logits(target, records, tmp_path):
    cfg = cfg_for(draft_vocab=10, inject_anchor=True)
    tr = DrafterTrainer(target.model, cfg, frequent_vocab(records, 16, 10))
    export(tr, tmp_path / "d", dtype=torch.float32)
    cfg_json = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg_json["dflash_config"]["mask_token_id"] == 15 and cfg_json["dflash_config"]["draft_vocab_size"] == 10
    loaded = load_dflash(tmp_path / "d", target.model)
    live = to_drafter(tr, target.model)
    r = records[0]
    for d in (live, loaded):
        st = d.new_state()
        d.extend(st, r["ids"][:6].tolist(), r["features"][:6].float())
        d.out = d.propose(st, int(r["ids"][6]), 3)
    assert torch.equal(live.out.token_ids, loaded.out.token_ids)
    assert torch.equal(live.out.logprobs, loaded.out.logprobs)


def test_resume_continues_from_last_checkpoint(target, records, tmp_path):
    """3 steps + checkpoint + 2 resumed steps == 5 uninterrupted steps (same batches)."""
    cfg = cfg_for(draft_vocab=12)
    counts = torch.bincount(torch.cat([r["ids"][r["prompt_len"]:].long() for r in records]), minlength=16)
    batches = [make_batch(records[i % 3: i % 3 + 3], cfg, torch.Generator().manual_seed(i)) for i in range(5)]
    tr, opt = build(target.model, cfg, counts, None)
    for s in range(5):
        train_step(tr, opt, batches[s], s)
    tr2, opt2 = build(target.model, cfg, counts, None)
    for s in range(3):
        train_step(tr2, opt2, batches[s], s)
    save_ckpt(tmp_path / "ckpt.pt", tr2, opt2, {"step": 3})
    save_state(tmp_path / "state", tr2, opt2, {"step": 3, "gen_state": torch.Generator().manual_seed(5).get_state()})
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    tr3, opt3 = build(target.model, cfg_for(draft_vocab=0), None, ck)  # config and d2t come from the checkpoint
    assert torch.equal(tr3.model.d2t, tr.model.d2t)
    # The compact state (moments in bfloat16) resumes the same run up to the moments' rounding.
    st = load_state(tmp_path / "state")
    assert st["state"]["step"] == 3
    assert torch.equal(st["state"]["gen_state"], torch.Generator().manual_seed(5).get_state())
    tr4, opt4 = build(target.model, cfg_for(draft_vocab=0), None, st)
    assert torch.equal(tr4.model.d2t, tr.model.d2t)
    for (k, a), b in zip(tr2.model.state_dict().items(), tr4.model.state_dict().values()):
        assert torch.equal(a, b), k  # weights are stored in float32
    for s in range(3, 5):
        train_step(tr3, opt3, batches[s], s)
        train_step(tr4, opt4, batches[s], s)
    moved = 0.0
    for (k, a), b, c, d in zip(tr.model.state_dict().items(), tr3.model.state_dict().values(),
                               tr4.model.state_dict().values(), tr2.model.state_dict().values()):
        assert torch.equal(a, b), k
        if a.is_floating_point():
            # the bf16-moment resume lands within 2 % of the two steps' own movement
            torch.testing.assert_close(c, a, atol=0.02 * float((a - d).abs().max()) + 1e-7, rtol=0)
            moved = max(moved, float((a - d).abs().max()))
    assert moved > 0
    # Over the size limit the moments are left out; the resume keeps the weights and restarts AdamW.
    save_state(tmp_path / "lean", tr2, opt2, {"step": 3}, moments_limit=1)
    lean = load_state(tmp_path / "lean")
    assert lean["opt_named"] == {} and lean["state"]["step"] == 3
    assert (tmp_path / "lean" / "state.safetensors").stat().st_size < (tmp_path / "state" / "state.safetensors").stat().st_size
    tr5, opt5 = build(target.model, cfg_for(draft_vocab=0), None, lean)
    assert all(torch.equal(a, b) for a, b in zip(tr2.model.state_dict().values(), tr5.model.state_dict().values()))
    assert not opt5.state
    train_step(tr5, opt5, batches[3], 3)
    assert all(torch.isfinite(p).all() for p in tr5.model.parameters())


def _write_data(target, folder, n_shards=2):
    for k in range(n_shards):
        recs = greedy_records(target, seed=k, max_new=12)
        write_shard(folder, [Sequence(r["ids"].numpy(), r["prompt_len"], "test", False) for r in recs], "tiny")


def _stage_args(tmp_path, **kw) -> argparse.Namespace:
    """train_stage's arguments for the tiny target, 3 steps, data / state / features under tmp_path."""
    base = dict(block_size=4, layers=1, draft_vocab=12, no_inject=False, soft_weight=0.5, lr=1e-3, steps=3, batch=2,
                blocks=3, minutes=0, ckpt_minutes=100, eval_minutes=100, eval_prompts=0, eval_tokens=8, ship="",
                init="", data_dir=str(tmp_path / "data"), state_dir=str(tmp_path / "state"),
                feature_cache=str(tmp_path / "features"), top_k=4, autocast="off")
    base.update(kw)
    return argparse.Namespace(**base)


def test_train_stage_resumes_from_its_checkpoint_and_from_the_committed_state(target, tmp_path):
    """The stage runs to --steps and writes ckpt.pt and the compact state; a second run with a larger
    horizon continues it; without ckpt.pt (a new machine) it continues from the committed state."""
    _write_data(target, tmp_path / "data")
    args = _stage_args(tmp_path, val_steps=25)
    log = logging.getLogger("test")
    # A tiny config: the stage builds from args, so patch the target-specific fields through TrainConfig defaults.
    import training.train_loop as tl

    orig = tl.config_from_args
    tl.config_from_args = lambda a, c: cfg_for(draft_vocab=a.draft_vocab, steps=a.steps, batch=a.batch,
                                               blocks=a.blocks)
    try:
        train_stage(args, tmp_path, log, target=target)
        ck = torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)
        assert ck["state"]["step"] == 3 and ck["state"]["sampler"]["pos"] == 6
        assert ck["cfg"]["autocast"] is False  # --autocast off, over TrainConfig's default
        assert load_state(tmp_path / "state")["state"]["step"] == 3
        args.steps = 5
        train_stage(args, tmp_path, log, target=target)
        ck2 = torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)
        assert ck2["state"]["step"] == 5 and ck2["state"]["train_s"] > ck["state"]["train_s"]
        (tmp_path / "train" / "ckpt.pt").unlink()
        args.steps = 7
        train_stage(args, tmp_path, log, target=target)
        ck3 = torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)
        assert ck3["state"]["step"] == 7 and ck3["state"]["sampler"]["pos"] == 2  # 12 sequences a epoch
        assert ck3["state"]["sampler"]["epoch"] == 1
        # The loss log (every 25 steps) lives beside the state; lines past the resume point are dropped.
        args.steps = 26
        train_stage(args, tmp_path, log, target=target)
        loss = tmp_path / "state" / "loss.jsonl"
        assert [json.loads(x)["step"] for x in loss.read_text().splitlines()] == [25]
        loss.write_text(loss.read_text() + json.dumps({"step": 99}) + "\n")  # written after the last checkpoint
        args.steps = 27
        train_stage(args, tmp_path, log, target=target)
        assert [json.loads(x)["step"] for x in loss.read_text().splitlines()] == [25]
        # A local checkpoint of another recipe (an older run on this machine) loses to the committed state,
        # even when it is further along.
        from training.train_loop import _resume_point

        other = torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)
        other["cfg"]["num_layers"] = 2
        other["state"]["step"] = 1000
        torch.save(other, tmp_path / "train" / "ckpt.pt")
        assert _resume_point(tmp_path / "train", tmp_path / "state")["state"]["step"] == 27
        other["cfg"]["num_layers"], other["cfg"]["steps"] = 1, 5000  # same recipe, longer horizon: the newer wins
        other["cfg"]["autocast"] = not other["cfg"]["autocast"]  # autocast is the machine's choice, not the recipe
        torch.save(other, tmp_path / "train" / "ckpt.pt")
        assert _resume_point(tmp_path / "train", tmp_path / "state")["state"]["step"] == 1000
        # A state whose two files disagree (an interrupted write) is refused, not half-loaded.
        body = json.loads((tmp_path / "state" / "state.json").read_text())
        body["state"]["step"] = 3
        (tmp_path / "state" / "state.json").write_text(json.dumps(body))
        with pytest.raises(ValueError, match="interrupted"):
            load_state(tmp_path / "state")
    finally:
        tl.config_from_args = orig


def test_export_stage_writes_the_newest_state_as_a_loadable_drafter(target, tmp_path):
    """`export_latest` picks the state a resume would (the committed one once ckpt.pt is gone) and
    writes its weights, in bfloat16, as a folder `load_dflash` reads; no state at all is refused."""
    from safetensors.torch import load_file

    import training.train_loop as tl
    from training.train_loop import export_latest

    with pytest.raises(SystemExit, match="no training state"):
        export_latest(tmp_path, tmp_path / "state", target.model, tmp_path / "latest")
    _write_data(target, tmp_path / "data")
    args = _stage_args(tmp_path, val_steps=0)
    orig = tl.config_from_args
    tl.config_from_args = lambda a, c: cfg_for(draft_vocab=a.draft_vocab, steps=a.steps, batch=a.batch,
                                               blocks=a.blocks)
    try:
        train_stage(args, tmp_path, logging.getLogger("test"), target=target)
    finally:
        tl.config_from_args = orig
    (tmp_path / "train" / "ckpt.pt").unlink()  # a new machine: only the committed state is left
    state = export_latest(tmp_path, tmp_path / "state", target.model, tmp_path / "latest")
    assert state["step"] == 3
    saved = load_state(tmp_path / "state")["model"]
    written = load_file(str(tmp_path / "latest" / "model.safetensors"))
    assert set(written) == set(saved)
    for k, v in saved.items():
        want = v.long() if k == "d2t" else v.to(torch.bfloat16)
        assert torch.equal(written[k], want), k
    assert load_dflash(tmp_path / "latest", target.model).spec.block_size == 4


def test_echo_repeats_only_batches_that_ran_the_target_and_resumes_mid_repeat(target, tmp_path):
    """--echo 2: each batch whose features were computed trains two steps (the sampler advances
    every other step), batches read from the cache train once, and a run stopped between the
    two steps of a repeat resumes into the repeat's second step."""
    _write_data(target, tmp_path / "data")
    args = _stage_args(tmp_path, val_steps=0, echo=2)
    log = logging.getLogger("test")
    import training.train_loop as tl

    orig = tl.config_from_args
    tl.config_from_args = lambda a, c: cfg_for(draft_vocab=a.draft_vocab, steps=a.steps, batch=a.batch,
                                               blocks=a.blocks)
    calls = []
    orig_records = tl.TokenData.records
    tl.TokenData.records = lambda self, idx: calls.append(list(idx)) or orig_records(self, idx)
    try:
        train_stage(args, tmp_path, log, target=target)  # steps 1-3: batch A twice, then B once
        st = load_state(tmp_path / "state")["state"]
        # the start-up probe read the first 2 training sequences: their batch, if drawn, is cached
        assert st["step"] == 3 and st["sampler"]["pos"] == 4
        assert st["echo_left"] == 1 and st["echoed"] == 1
        a, b = calls[1:3], calls[3]
        assert a[0] == a[1] and b != a[0] and st["echo_idx"] == b
        calls.clear()
        (tmp_path / "train" / "ckpt.pt").unlink()  # a new machine: the committed state alone
        args.steps = 4
        train_stage(args, tmp_path, log, target=target)
        st = load_state(tmp_path / "state")["state"]
        assert calls[-1] == b  # the repeat's second step, not a new batch
        assert st["step"] == 4 and st["sampler"]["pos"] == 4 and st["echo_left"] == 0 and st["echoed"] == 2
        # Epoch 0 repeats every batch but one made only of the start-up probe's (cached) sequences;
        # epoch 1 reads every batch from the cache and repeats none.
        sampler = tl.EpochSampler(0)
        epoch0 = [set(sampler.take(12, 2)) for _ in range(6)]
        computed = sum(not b <= {0, 1} for b in epoch0)  # train_idx positions 0, 1: the probe
        assert computed >= 5
        args.steps = 6 + computed + 3
        train_stage(args, tmp_path, log, target=target)
        st = load_state(tmp_path / "state")["state"]
        assert st["sampler"]["epoch"] == 1 and st["sampler"]["pos"] == 6
        assert st["echoed"] == computed and st["echo_left"] == 0
    finally:
        tl.config_from_args = orig
        tl.TokenData.records = orig_records


def test_feature_layer_count_and_training_subset_reach_the_run(tmp_path):
    """--feature-layers N reads N target layers by the default rule (SmolLM2's 30 layers: 3 -> the
    default [1, 14, 27], 5 -> [1, 8, 14, 20, 27]) and the run trains on exactly those features;
    --train-sequences N trains on the first N training sequences only, the held-out set whole."""
    from dataclasses import replace
    from types import SimpleNamespace

    from helpers import tiny_target

    from training.train_loop import layer_ids_for

    smol = SimpleNamespace(num_hidden_layers=30)
    assert layer_ids_for(smol) == [1, 14, 27] and layer_ids_for(smol, 5) == [1, 8, 14, 20, 27]
    for bad in (0, 28, 31):  # 28 of 30 would read layer 14 twice
        with pytest.raises(ValueError, match="feature layers"):
            layer_ids_for(smol, bad)
    deep = tiny_target(vocab=16, seed=3, layers=6)
    _write_data(deep, tmp_path / "data")  # 2 shards of 6 sequences
    fw = TargetForward(deep.model, packed=False)
    sub = TokenData(tmp_path / "data", fw, (2, 4), tmp_path / "features", top_k=4, holdout_every=3, max_train=5)
    sub.refresh()
    assert sub.train_idx == [0, 1, 3, 4, 6] and sub.val_idx == [2, 5, 8, 11]
    used = sum(len(sub.ids[i]) - sub.prompt_lens[i] for i in sub.train_idx + sub.val_idx)
    assert sub.tokens == used
    _write_data(deep, tmp_path / "more", n_shards=3)  # the same 2 shards and a new one: the cap holds
    sub.folder = tmp_path / "more"
    assert sub.refresh() == 1 and len(sub) == 18
    assert sub.train_idx == [0, 1, 3, 4, 6] and sub.val_idx == [2, 5, 8, 11, 14, 17]
    with pytest.raises(ValueError, match="max_train"):
        TokenData(tmp_path / "data", fw, (2, 4), tmp_path / "features", max_train=-1)
    args = _stage_args(tmp_path, val_steps=0, feature_layers=2, train_sequences=5, steps=4)
    import training.train_loop as tl

    orig, orig_records = tl.config_from_args, tl.TokenData.records
    tl.config_from_args = lambda a, c: replace(orig(a, c), mask_token_id=15, intermediate_size=64, warmup=0.0)
    seen = []
    tl.TokenData.records = lambda self, idx: seen.append((self.layers, list(idx))) or orig_records(self, idx)
    try:
        train_stage(args, tmp_path, logging.getLogger("test"), target=deep)
    finally:
        tl.config_from_args, tl.TokenData.records = orig, orig_records
    ck = torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)
    assert ck["cfg"]["target_layer_ids"] == [1, 3]  # default_target_layer_ids(6, 2)
    assert ck["state"]["step"] == 4 and ck["state"]["sampler"]["n"] == 5
    assert {layers for layers, _ in seen} == {(2, 4)}  # hidden_states indices of layers 1 and 3
    assert set().union(*(set(i) for _, i in seen)) <= set(range(5))  # no held-out count: the first 5 of 12
    w = ck["model"]
    fc = [v for k, v in w.items() if k.endswith("fc.weight")]
    assert fc and fc[0].shape[1] == 2 * 32  # the projection reads two layers of width 32
    args.steps, args.train_sequences = 5, 0  # resuming on other data is refused, not silently mixed
    with pytest.raises(SystemExit, match="train-sequences 5"):
        train_stage(args, tmp_path, logging.getLogger("test"), target=deep)


def test_train_stage_dtype_follows_the_data_so_captured_features_are_found(tmp_path):
    from bastion.train_drafter import train_dtype

    def ns(dtype):
        return argparse.Namespace(data_dtype=dtype, data_dir=str(tmp_path))

    assert train_dtype(ns("auto")) == "auto"  # no data yet: measure
    for dt in ("bfloat16", "bfloat16", "float32"):
        write_shard(tmp_path, [Sequence(torch.arange(6).numpy(), 2, "x", True)], "tiny", meta={"dtype": dt})
    assert train_dtype(ns("auto")) == "bfloat16"
    assert train_dtype(ns("float32")) == "float32"


def test_held_out_sequences_are_excluded_from_training_and_scored_by_validate(target, tmp_path):
    """Every holdout_every-th sequence of a shard is held out: not in train_idx, not in the vocabulary
    counts; validate() gives the mean teacher-forced metrics of exactly those sequences, in eval mode."""
    _write_data(target, tmp_path / "data", n_shards=2)  # 6 sequences a shard
    fw = TargetForward(target.model, packed=False)
    data = TokenData(tmp_path / "data", fw, tuple(i + 1 for i in LAYERS), tmp_path / "features", top_k=4,
                     holdout_every=3)
    data.refresh()
    assert data.val_idx == [2, 5, 8, 11]
    assert sorted(data.train_idx + data.val_idx) == list(range(12))
    counts = torch.zeros(16, dtype=torch.long)
    for i in data.train_idx:
        counts += torch.bincount(data.ids[i][data.prompt_lens[i]:].long(), minlength=16)
    assert torch.equal(data.counts(16), counts)
    every = TokenData(tmp_path / "data", fw, tuple(i + 1 for i in LAYERS), tmp_path / "features", top_k=4,
                      holdout_every=0)
    every.refresh()
    assert every.val_idx == [] and every.counts(16).sum() > counts.sum()

    torch.manual_seed(0)
    trainer = DrafterTrainer(target.model, cfg_for(blocks=3))
    trainer.model.train()
    got = validate(trainer, data, seed=5, batch=3)
    assert trainer.model.training  # restored
    gen = torch.Generator().manual_seed(5)
    trainer.model.eval()
    acc, tau, loss = [], [], []
    with torch.no_grad():
        for i in (0, 3):
            b = make_batch(data.records(data.val_idx[i:i + 3]), trainer.cfg, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = trainer(b)
            acc.append(float(out["acc1"]))
            tau.append(float(out["est_tau"]))
            loss.append(float(out["loss"]))
    assert got["val_acc1"] == pytest.approx(sum(acc) / 2, abs=1e-4)
    assert got["val_tau_est"] == pytest.approx(sum(tau) / 2, abs=1e-4)
    assert got["val_loss"] == pytest.approx(sum(loss) / 2, abs=1e-4)
    assert 1.0 <= got["val_tau_est"] <= 4.0


def test_walk_replays_greedy_speculative_decoding_through_the_engine(target, records):
    """walk_steps (teacher-forced, every anchor in one forward) gives the accepted count of each step
    that chain decoding through engine.Engine takes on the record's prompt, and walk_tau their mean."""
    from engine.engine import Engine, make_controller
    from engine.sampling import SamplingParams
    from training.train_loop import walk_steps, walk_tau

    cfg = cfg_for(autocast=False, blocks=8, steps=80)
    tr, opt = build(target.model, cfg, None, None)
    gen = torch.Generator().manual_seed(0)
    for s in range(80):  # enough training that some drafts are accepted
        train_step(tr, opt, make_batch(records[s % 3: s % 3 + 3], cfg, gen), s)
    tr.eval()
    drafter = to_drafter(tr, target.model)
    eng = Engine(target, drafter, make_controller("chain", 32, drafter.max_depth + 1))
    total_walk = []
    for rec in records:
        pl, n = rec["prompt_len"], len(rec["ids"])
        want = walk_steps(tr, rec)
        res = eng.generate(rec["ids"][:pl].tolist(), SamplingParams(max_tokens=n - pl, ignore_eos=True))
        assert res.token_ids == rec["ids"][pl:].tolist()  # the record is the target's greedy answer
        got = [s.accepted for s in res.steps]
        assert got[:-1] == want[:-1] and sum(got) <= sum(want)  # the last step may be cut at max_tokens
        total_walk += want
    assert max(total_walk) > 1  # the drafter was accepted somewhere: the replay was tested, not just AR
    assert walk_tau(tr, records)[0] == pytest.approx(sum(total_walk) / len(total_walk))
    short5 = [k for r in records for k in walk_steps(tr, r, max_new=5)]
    assert walk_tau(tr, records, (None, 5)) == pytest.approx([sum(total_walk) / len(total_walk),
                                                             sum(short5) / len(short5)])
    cut = records[0]["prompt_len"] + 5  # max_new decodes the first 5 response tokens of the record
    short = {**records[0], "ids": records[0]["ids"][:cut], "features": records[0]["features"][:cut - 1]}
    assert walk_steps(tr, records[0], max_new=5) == walk_steps(tr, short) and sum(walk_steps(tr, short)) >= 4
