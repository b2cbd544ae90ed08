"""Exact stopping (EOS, stop strings, max_tokens) inside long accepted paths, and cache compaction."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from engine.forward import Segment
from helpers import OracleDrafter

PROMPT = "Describe a rainy afternoon in a small town."
N = 48


@pytest.fixture(scope="module")
def ref(target_f32):
    ar = Engine(target_f32)
    ids = ar.chat_prompt_ids([{"role": "user", "content": PROMPT}])
    r = ar.generate(ids, SamplingParams(max_tokens=N))
    assert r.finish_reason == "length" and len(r.token_ids) == N
    return ids, r.token_ids, r.text


def oracle_engine(target, ids, out, mode="chain", budget=16, decoy=0):
    d = OracleDrafter(ids + out + [0] * 16, target.config.vocab_size, decoy_every=decoy)
    return Engine(target, d, make_controller(mode, budget))


def first_occurrences(out, lo, hi):
    return [j for j in range(lo, hi + 1) if out[j] not in out[:j]]


def test_oracle_chain_step_boundaries(target_f32, ref):
    ids, out, text = ref
    r = oracle_engine(target_f32, ids, out).generate(ids, SamplingParams(max_tokens=N))
    assert r.token_ids == out and r.text == text
    # Prefill gives token 0; each step then accepts 15 drafted tokens + the bonus.
    assert [s.accepted for s in r.steps] == [16, 16, 15]
    assert len(r.token_ids) == 1 + sum(s.accepted for s in r.steps)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_eos_inside_accepted_path(target_f32, ref, where):
    ids, out, text = ref
    # Step 2 of the chain commits tokens 17..32: put the EOS at its start, middle or end.
    cands = first_occurrences(out, 17, 32)
    want = {"start": 17, "middle": 24, "end": 32}[where]
    j = min(cands, key=lambda c: abs(c - want))
    eng = oracle_engine(target_f32, ids, out)
    eng.eos_ids = {out[j]}
    r = eng.generate(ids, SamplingParams(max_tokens=N))
    assert r.finish_reason == "stop"
    assert r.token_ids == out[:j]
    assert r.text == target_f32.tokenizer.decode(out[:j], skip_special_tokens=True)
    assert len(r.token_ids) == 1 + sum(s.accepted for s in r.steps)


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_stop_string_inside_accepted_path(target_f32, ref, where):
    ids, out, text = ref
    tok = target_f32.tokenizer
    want = {"start": 17, "middle": 24, "end": 32}[where]
    for j in sorted(range(12, 36), key=lambda c: abs(c - want)):
        off = len(tok.decode(out[:j], skip_special_tokens=True))
        stop = text[off: off + 5]
        if len(stop.strip()) >= 3 and text.find(stop) == off:
            break
    else:
        pytest.fail("no unique stop string found")
    params = SamplingParams(max_tokens=N, stop=[stop])
    spec = oracle_engine(target_f32, ids, out).generate(ids, params)
    plain = Engine(target_f32).generate(ids, params)
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert spec.text == plain.text == text[:off]
    assert spec.token_ids == plain.token_ids
    k = len(spec.token_ids)
    # The kept tokens end with the one completing the stop string.
    assert stop in tok.decode(out[:k]) and stop not in tok.decode(out[: k - 1])
    assert len(spec.token_ids) == 1 + sum(s.accepted for s in spec.steps)


def test_stop_string_never_leaks_into_stream(target_f32, ref):
    ids, out, text = ref
    stop = text[40:52]
    assert text.find(stop) == 40
    eng = oracle_engine(target_f32, ids, out)
    pieces = [ev.text for ev in eng.stream(ids, SamplingParams(max_tokens=N, stop=[stop]))]
    streamed = ""
    for p in pieces:
        streamed += p
        assert stop[:3] not in streamed[38:] or streamed == text[:40]
    assert streamed == text[:40]


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 24, 32, 33, 47])
def test_max_tokens_never_exceeded_nor_cut_short(target_f32, ref, m):
    ids, out, _ = ref
    r = oracle_engine(target_f32, ids, out, "tree", 32).generate(ids, SamplingParams(max_tokens=m))
    assert r.token_ids == out[:m] and r.finish_reason == "length"
    assert len(r.token_ids) == 1 + sum(s.accepted for s in r.steps)


def test_cache_equals_fresh_prefill_after_many_steps(target_f32, ref):
    ids, out, _ = ref
    # Decoys make accepted paths non-contiguous in insertion order, so compaction gathers.
    eng = oracle_engine(target_f32, ids, out, "tree", 32, decoy=3)
    seq = eng.start(ids, SamplingParams(max_tokens=N))
    gathered = 0
    while True:
        ev = eng.step(seq)
        if ev.finish_reason:
            break
        gathered += int(ev.step.accepted_depth > 0)
        committed = ids + seq.output_ids[:-1]  # the root (last token) is not cached yet
        assert seq.prefix_len == len(committed)
        fresh = eng.forward.new_pool(1, len(committed))
        n = len(committed)
        eng.forward(fresh, torch.tensor(committed), torch.arange(n), [Segment(0, 0, n)], last_only=True)
        kept = eng.pool.keys[:, seq.slot, :, :n], eng.pool.values[:, seq.slot, :, :n]
        torch.testing.assert_close(kept[0], fresh.keys[:, 0], atol=2e-4, rtol=1e-3)
        torch.testing.assert_close(kept[1], fresh.values[:, 0], atol=2e-4, rtol=1e-3)
    assert seq.output_ids == out and gathered >= 2
    assert seq.slot == -1 and eng.pool.free_slots == eng.pool.num_slots  # the finished sequence gave its slot back
