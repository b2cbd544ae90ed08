"""The drafter's committed training data: token shards, batched generation, Magpie prompts, cached features."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import tiny_target

from engine.forward import TargetForward
from engine.sampling import SamplingParams
from training import datagen
from training.datagen import acceptable_user_turn, folder_prompt_texts, magpie_prompts, prompt_key, user_prefix_ids
from training.features import teacher_forced
from training.generate import Decoded, decode_many
from training.prompts import OVERLAP_SPAN, _span_index, default_benchmark_texts, word_spans
from training.shards import DEFAULT_DATA_DIR, Sequence, ShardError, read_all, read_manifest, write_shard
from training.train import TrainConfig, make_batch
from training.train_loop import EpochSampler, TokenData

LAYERS = (1, 2)  # HF hidden-state indices of the tiny 2-layer target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(vocab=16, seed=3)


@pytest.fixture(scope="module")
def fw(tiny):
    return TargetForward(tiny.model, packed=False)


def _seqs(n: int, seed: int = 0) -> list[Sequence]:
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pl = int(g.integers(2, 6))
        ids = g.integers(0, 16, size=pl + int(g.integers(3, 12)))
        out.append(Sequence(ids, pl, "template" if i % 2 else "magpie", bool(i % 3)))
    return out


# ---- shards -------------------------------------------------------------------------------------


def test_shards_round_trip_with_checksums_and_totals(tmp_path):
    a, b = _seqs(5, 0), _seqs(3, 1)
    e0 = write_shard(tmp_path, a, "tiny", meta={"max_new": 12})
    write_shard(tmp_path, b, "tiny")
    man = read_manifest(tmp_path)
    assert [s["file"] for s in man["shards"]] == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert e0["max_new"] == 12 and e0["per_source"] == {"magpie": 3, "template": 2}
    assert man["totals"]["sequences"] == 8
    assert man["totals"]["response_tokens"] == sum(len(s.ids) - s.prompt_len for s in a + b)
    back = read_all(tmp_path)
    assert len(back) == 8
    for want, got in zip(a + b, back):
        assert np.array_equal(want.ids, got.ids) and got.ids.dtype == np.int64
        assert (want.prompt_len, want.source, want.ended) == (got.prompt_len, got.source, got.ended)
    assert (tmp_path / "shard_00000.safetensors").stat().st_size < 2 * sum(len(s.ids) for s in a) + 1024


def test_shard_checksum_and_bad_input_are_refused(tmp_path):
    write_shard(tmp_path, _seqs(4), "tiny")
    with pytest.raises(ShardError, match="another target|holds data"):
        write_shard(tmp_path, _seqs(2), "other")
    with pytest.raises(ShardError, match="uint16"):
        write_shard(tmp_path, [Sequence(np.array([1, 70000, 3]), 1, "x", True)], "tiny")
    with pytest.raises(ShardError, match="prompt_len"):
        write_shard(tmp_path, [Sequence(np.array([1, 2]), 3, "x", True)], "tiny")
    with pytest.raises(ShardError, match="at least one"):
        write_shard(tmp_path, [], "tiny")
    path = tmp_path / "shard_00000.safetensors"
    good = path.read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="checksum"):
        read_all(tmp_path)
    path.write_bytes(good)
    assert len(read_all(tmp_path)) == 4
    path.unlink()
    with pytest.raises(ShardError, match="missing"):
        read_all(tmp_path)


def test_shards_reproduce_the_same_training_batches(tmp_path, fw):
    """Records built from shards read back give the batches the in-memory records give, seed for seed."""
    seqs = _seqs(6)
    write_shard(tmp_path, seqs, "tiny")
    cfg = TrainConfig(block_size=4, target_layer_ids=(0, 1), blocks=3, batch=3)

    def records(ss):
        tf = teacher_forced(fw, [(s.ids, s.prompt_len) for s in ss], LAYERS, 4)
        return [{"ids": torch.from_numpy(s.ids).int(), "prompt_len": s.prompt_len, **f} for s, f in zip(ss, tf)]

    mem, disk = records(seqs), records(read_all(tmp_path))
    for seed in range(3):
        b1 = make_batch(mem[seed:seed + 3], cfg, torch.Generator().manual_seed(seed))
        b2 = make_batch(disk[seed:seed + 3], cfg, torch.Generator().manual_seed(seed))
        assert b1.keys() == b2.keys()
        for k in b1:
            assert torch.equal(b1[k], b2[k]), k


# ---- generation -------------------------------------------------------------------------------------


def _greedy_alone(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_decode_many_refills_slots_and_equals_greedy_alone(tiny, fw):
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [2, 2], [7, 1, 3, 3], [9, 9, 9]]
    seen = []
    out = decode_many(fw, prompts, 10, set(), slots=2, prefill_tokens=4, on_done=seen.append)
    assert [d.index for d in out] == list(range(6)) and sorted(d.index for d in seen) == list(range(6))
    for p, d in zip(prompts, out):
        assert d.response == _greedy_alone(tiny.model, p, 10) and not d.ended
    # Features and top-k captured while decoding equal a teacher-forced pass over the result.
    cap = decode_many(fw, prompts, 10, set(), slots=2, feature_layers=LAYERS, top_k=4)
    tf = teacher_forced(fw, [(np.array(p + d.response), len(p)) for p, d in zip(prompts, cap)], LAYERS, 4)
    for p, d, want in zip(prompts, cap, tf):
        assert d.features.shape == (len(p) + 9, 64) and d.top_ids.shape == (10, 4)
        torch.testing.assert_close(d.features.float(), want["features"].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(d.top_ids, want["top_ids"])
        torch.testing.assert_close(d.top_lp.float(), want["top_lp"].float(), atol=1e-2, rtol=1e-2)


def test_decode_many_stops_at_eos_and_samples_reproducibly(tiny, fw):
    prompts = [[1, 2, 3], [4, 5]] * 3
    free = decode_many(fw, prompts, 12, set())
    eos = {free[0].response[4]}
    stopped = decode_many(fw, prompts, 12, eos)
    for f, s in zip(free, stopped):
        cut = next((i for i, t in enumerate(f.response) if t in eos), None)
        assert s.response == (f.response if cut is None else f.response[:cut + 1])
        assert s.ended == (cut is not None)
    params = SamplingParams(temperature=1.0, max_tokens=12)
    a = decode_many(fw, prompts, 12, set(), params, generator=torch.Generator().manual_seed(4))
    b = decode_many(fw, prompts, 12, set(), params, generator=torch.Generator().manual_seed(4))
    c = decode_many(fw, prompts, 12, set(), params, generator=torch.Generator().manual_seed(5))
    assert [d.response for d in a] == [d.response for d in b] != [d.response for d in c]
    with pytest.raises(ValueError):
        decode_many(fw, [[]], 4, set())
    with pytest.raises(ValueError):
        decode_many(fw, [[1]], 0, set())


# ---- features -------------------------------------------------------------------------------------


def test_cached_features_equal_teacher_forced_and_are_computed_once(tmp_path, fw, monkeypatch):
    seqs = _seqs(7)
    write_shard(tmp_path / "data", seqs[:4], "tiny")
    write_shard(tmp_path / "data", seqs[4:], "tiny")
    data = TokenData(tmp_path / "data", fw, LAYERS, tmp_path / "cache", top_k=4)
    assert data.refresh() == 2 and len(data) == 7 and data.refresh() == 0
    want = teacher_forced(fw, [(s.ids, s.prompt_len) for s in seqs], LAYERS, 4)
    got = data.records([5, 0, 2])
    for i, r in zip([5, 0, 2], got):
        assert r["prompt_len"] == seqs[i].prompt_len and np.array_equal(r["ids"].numpy(), seqs[i].ids)
        for k in ("features", "top_ids", "top_lp"):
            assert torch.equal(r[k], want[i][k]), k
    # A new process over the same cache reads what was computed and computes only the rest.
    calls = []
    real = teacher_forced

    def counting(fw_, ss, *a, **kw):
        calls.append(len(ss))
        return real(fw_, ss, *a, **kw)

    import training.train_loop as tl

    monkeypatch.setattr(tl, "teacher_forced", counting)
    again = TokenData(tmp_path / "data", fw, LAYERS, tmp_path / "cache", top_k=4)
    again.refresh()
    for i, r in zip([0, 2, 5], again.records([0, 2, 5])):
        assert torch.equal(r["features"], want[i]["features"])
    assert calls == []
    rest = again.records(list(range(7)))
    assert calls == [4]
    for i, r in enumerate(rest):
        assert torch.equal(r["top_lp"], want[i]["top_lp"])


def test_epoch_sampler_visits_every_sequence_once_per_epoch_and_resumes():
    s = EpochSampler(seed=3)
    first = s.take(10, 4) + s.take(10, 4)
    tail = s.take(10, 4)  # crosses into epoch 1
    assert sorted(first + tail[:2]) == list(range(10)) and s.epoch == 1
    saved = s.state_dict()
    more = s.take(12, 5)  # data grew: joins at the next epoch
    again = EpochSampler.from_state(saved)
    assert again.take(12, 5) == more
    epoch1 = tail[2:] + more + s.take(12, 3)
    assert sorted(epoch1) == list(range(10)) and s.epoch == 1
    epoch2 = s.take(12, 12)
    assert sorted(epoch2) == list(range(12)) and epoch2 != list(range(12))
    # Resumed over less data than the epoch was drawn over: a new epoch over what is loaded.
    fewer = EpochSampler.from_state({"seed": 3, "epoch": 4, "pos": 2, "n": 12})
    assert sorted(fewer.take(5, 5)) == list(range(5)) and fewer.epoch == 5
    with pytest.raises(ValueError):
        EpochSampler(seed=0).take(0, 1)


def test_feature_store_refuses_rows_of_the_wrong_shape(tmp_path):
    from training.features import FeatureStore

    st = FeatureStore(tmp_path, "k", [5, 4], [2, 1], width=6, top_k=2)
    good = {"features": torch.zeros(4, 6, dtype=torch.bfloat16), "top_ids": torch.zeros(3, 2, dtype=torch.int32),
            "top_lp": torch.zeros(3, 2, dtype=torch.float16)}
    with pytest.raises(ValueError, match="shapes"):
        st.put(0, dict(good, features=torch.zeros(1, 6, dtype=torch.bfloat16)))
    assert st.missing([0, 1]) == [0, 1]
    st.put(0, good)
    assert st.missing([0, 1]) == [1]
    with pytest.raises(ValueError, match="bytes"):
        FeatureStore(tmp_path, "k", [5, 4, 3], [2, 1, 1], width=6, top_k=2)  # another layout under the same key


# ---- Magpie prompts and the committed data ---------------------------------------------------------


def test_user_prefix_is_the_template_up_to_the_user_text(target_f32):
    tok = target_f32.tokenizer
    prefix = user_prefix_ids(tok)
    full = datagen.chat_ids(tok, "Hello there")
    assert full[:len(prefix)] == prefix
    assert tok.decode(prefix).endswith("<|im_start|>user\n")


def test_magpie_prompts_filter_dedupe_and_avoid_benchmarks(target_f32, monkeypatch):
    tok = target_f32.tokenizer
    bench_text = default_benchmark_texts()[0]
    texts = [("Can you explain how a hash map works?", True),
             ("can you explain how a HASH map works", True),  # duplicate after normalisation
             (bench_text, True),  # a benchmark prompt
             ("Write a poem about the sea.", False),  # truncated: no EOS
             ("ok", True),  # too short
             ("What is the capital of a country with many islands?", True)]

    def fake(fw_, prompts, max_new, eos, params, **kw):
        return [Decoded(i, tok(t, add_special_tokens=False)["input_ids"], e) for i, (t, e) in enumerate(texts)]

    monkeypatch.setattr(datagen, "decode_many", fake)
    seen = {prompt_key("What is the capital of a country with many islands?")}
    got = magpie_prompts(SimpleNamespace(device=torch.device("cpu")), tok, {2}, 5, seed=0, seen=seen, benchmark_index=_span_index([bench_text], OVERLAP_SPAN))
    assert got == ["Can you explain how a hash map works?"]
    assert acceptable_user_turn("Tell me about trees, please.") and not acceptable_user_turn("¿Qué? " * 5)


def test_committed_data_verifies_and_shares_no_span_with_any_benchmark(target_f32):
    """Every committed shard matches its checksum, and no prompt shares an OVERLAP_SPAN-word span
    with a benchmark prompt (the Magpie prompts included)."""
    man = read_manifest(DEFAULT_DATA_DIR)
    if not man["shards"]:
        pytest.skip("no committed drafter data")
    seqs = read_all(DEFAULT_DATA_DIR)
    assert len(seqs) == man["totals"]["sequences"]
    texts = folder_prompt_texts(DEFAULT_DATA_DIR, target_f32.tokenizer)
    assert len(texts) == len(seqs) and all(texts)
    index = _span_index(default_benchmark_texts(), OVERLAP_SPAN)
    bad = [t for t in texts if not index.isdisjoint(word_spans(t))]
    assert bad == []
    sources = {s.source for s in seqs}
    assert sources == {"template", "magpie"}
    assert len({prompt_key(t) for t in texts}) >= 0.99 * len(texts)


def test_build_shards_appends_resumably_and_caches_the_captured_features(target_f32, tmp_path, monkeypatch):
    """The data stage writes template + Magpie shards, resumes by shard index, and leaves the features it
    captured in the cache, where the train stage finds them without a teacher-forced pass."""
    from engine.forward import target_forward_for

    fw32 = target_forward_for(target_f32.model)
    layers = (2, 15, 28)
    monkeypatch.setattr(datagen, "MAGPIE_PARAMS", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=32))
    kw = dict(shard_prompts=4, max_new=6, slots=4, feature_cache=tmp_path / "cache", feature_layers=layers, top_k=4)
    man = datagen.build_shards(tmp_path / "data", target_f32, fw32, 10**9, max_shards=1, **kw)
    assert len(man["shards"]) == 1 and man["shards"][0]["per_source"]["template"] == 2
    assert 1 <= man["shards"][0]["per_source"].get("magpie", 0) <= 2
    man = datagen.build_shards(tmp_path / "data", target_f32, fw32, 10**9, max_shards=1, **kw)
    assert len(man["shards"]) == 2
    texts = folder_prompt_texts(tmp_path / "data", target_f32.tokenizer)
    # shard 1 takes the next templates and new Magpie prompts
    assert len(texts) == man["totals"]["sequences"] >= 6 and len(set(map(prompt_key, texts))) == len(texts)
    import training.train_loop as tl

    monkeypatch.setattr(tl, "teacher_forced", lambda *a, **k: pytest.fail("features should come from the cache"))
    data = TokenData(tmp_path / "data", fw32, layers, tmp_path / "cache", top_k=4, min_response=1)
    data.refresh()
    got = data.records(list(range(len(data))))
    want = teacher_forced(fw32, [(r["ids"].numpy(), r["prompt_len"]) for r in got], layers, 4)
    for r, w in zip(got, want):
        torch.testing.assert_close(r["features"].float(), w["features"].float(), atol=5e-2, rtol=2e-2)
        assert torch.equal(r["top_ids"][:, 0], w["top_ids"][:, 0])
