"""The engine's KV pool: slots handed out and given back, growth keeps contents, writes stay inside
their slot, and the engine neither leaks slots nor writes past one; dtype 'auto' keeps the cheaper."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, make_controller
from engine.kv_cache import CacheCapacityError, KVPool, SlotsExhaustedError
from engine.sampling import SamplingParams
from helpers import OracleDrafter, tiny_target


def test_slots_are_handed_out_once_and_given_back():
    pool = KVPool(2, 2, 1, 8, 4)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.free_slots == 0
    with pytest.raises(SlotsExhaustedError):
        pool.allocate()
    pool.release(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(7)
    assert pool.allocate() == a


def test_growth_keeps_every_held_slot():
    pool = KVPool(2, 1, 1, 8, 4)
    s = pool.allocate()
    keys, values = pool.slot_views(s, 3)
    keys[1].copy_(torch.ones(1, 3, 4))
    values[1].copy_(2 * torch.ones(1, 3, 4))
    pool.grow(3)
    assert pool.num_slots == 3 and pool.free_slots == 2
    k, v = (t[1] for t in pool.slot_views(s, 3))
    assert torch.equal(k, torch.ones(1, 3, 4)) and torch.equal(v, 2 * torch.ones(1, 3, 4))
    assert {pool.allocate(), pool.allocate()} == {1, 2}
    with pytest.raises(ValueError, match="shrink"):
        pool.grow(2)


def test_a_write_past_the_capacity_is_refused_and_writes_nothing():
    pool = KVPool(1, 2, 1, 8, 2)
    pool.keys.zero_()
    with pytest.raises(CacheCapacityError, match="9 tokens"):
        pool.slot_views(0, 6 + 3)
    pool.slot_views(0, 5 + 3)[0][0, :, 5:].copy_(torch.ones(1, 3, 2))  # exactly to the end
    assert pool.keys[0, 0, :, 5:].eq(1).all() and not pool.keys[0, 1].any() and not pool.keys[0, 0, :, :5].any()


def test_engine_gives_every_slot_back_finished_cancelled_or_abandoned():
    target = tiny_target(vocab=32, layers=2, hidden=32)
    prompt = [3, 5, 7]
    eng = Engine(target)
    ref = eng.generate(prompt, SamplingParams(max_tokens=12)).token_ids
    drafter = OracleDrafter(prompt + ref + [0] * 16, 32, decoy_every=2)
    eng = Engine(target, drafter, make_controller("tree", 8))
    assert eng.generate(prompt, SamplingParams(max_tokens=12)).token_ids == ref
    stream = eng.stream(prompt, SamplingParams(max_tokens=12), should_cancel=lambda: True)
    assert [ev.finish_reason for ev in stream][-1] == "cancelled"
    abandoned = eng.stream(prompt, SamplingParams(max_tokens=12))
    next(abandoned)
    abandoned.close()
    seqs = [eng.start(prompt, SamplingParams(max_tokens=12)) for _ in range(3)]  # the pool grows to hold them
    assert eng.pool.num_slots >= 3
    for seq in seqs:
        eng.release(seq)
        eng.release(seq)  # idempotent
    assert eng.pool.free_slots == eng.pool.num_slots


def test_a_prompt_at_the_context_limit_is_refused_before_any_work():
    from engine.engine import ContextLengthError

    target = tiny_target(vocab=32, layers=2, hidden=32)
    eng = Engine(target)
    limit = eng.max_context()
    with pytest.raises(ContextLengthError) as err:
        eng.start([1] * (limit - 3), SamplingParams(max_tokens=4))
    assert err.value.param == "messages"
    with pytest.raises(ContextLengthError) as err:  # max_tokens alone leaves no room: it is named
        eng.start([1, 2], SamplingParams(max_tokens=10 ** 9))
    assert err.value.param == "max_tokens" and "10000000" in str(err.value).replace("_", "")
    with pytest.raises(ContextLengthError) as err:  # a prompt that fills the context is named alone
        eng.start([1] * limit, SamplingParams(max_tokens=1))
    assert err.value.param == "messages" and "max_tokens" not in str(err.value)
    assert eng.pool.free_slots == eng.pool.num_slots
    seq = eng.start([1] * (limit - 4), SamplingParams(max_tokens=4, ignore_eos=True))  # fits exactly
    while seq.finish_reason is None:
        eng.step(seq)
    assert seq.prefix_len <= eng.pool.capacity and eng.pool.free_slots == eng.pool.num_slots


def test_choose_dtype_keeps_the_measured_cheaper_one(monkeypatch):
    import engine.timing as timing

    target = tiny_target(vocab=32, layers=2, hidden=32)
    real = timing.batch_verify_timer

    def slower_in_float32(model, *args, **kwargs):
        measure = real(model, *args, **kwargs)
        penalty = 1.0 if model.dtype == torch.float32 else 0.0  # far above any timing noise
        return lambda b, s, c: measure(b, s, c) + penalty

    monkeypatch.setattr(timing, "batch_verify_timer", slower_in_float32)
    dtype, costs = timing.choose_dtype(target.model, sizes=(1,), context=8, repeats=1)
    assert dtype == torch.bfloat16 and target.model.dtype == torch.bfloat16
    assert set(costs) == {"float32", "bfloat16"} and costs["float32"] > costs["bfloat16"]


def test_choose_dtype_never_rounds_the_weights_it_keeps(monkeypatch):
    import engine.timing as timing

    target = tiny_target(vocab=32, layers=2, hidden=32)
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    real = timing.batch_verify_timer

    def slower_in_bfloat16(model, *args, **kwargs):
        measure = real(model, *args, **kwargs)
        penalty = 1.0 if model.dtype == torch.bfloat16 else 0.0
        return lambda b, s, c: measure(b, s, c) + penalty

    monkeypatch.setattr(timing, "batch_verify_timer", slower_in_bfloat16)
    dtype, _ = timing.choose_dtype(target.model, sizes=(1,), context=8, repeats=1)
    assert dtype == torch.float32
    after = target.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit for bit: the trial ran on a copy


def test_choose_dtype_for_a_server_times_its_batched_step(monkeypatch):
    """A dtype faster for one sequence's trees but slower for the batched step of a server's
    max_running sequences loses when the batch is timed too, and only then."""
    import engine.timing as timing

    real = timing.batch_verify_timer
    seen = []

    def bf16_fast_alone_slow_batched(model, *args, **kwargs):
        measure = real(model, *args, **kwargs)
        bf16 = model.dtype == torch.bfloat16

        def timed(b, s, c):
            seen.append((str(model.dtype), b, s))
            return measure(b, s, c) + (0.0 if bf16 else 1.0) * (b == 1) + (5.0 if bf16 else 0.0) * (b > 1)
        return timed

    monkeypatch.setattr(timing, "batch_verify_timer", bf16_fast_alone_slow_batched)
    alone, _ = timing.choose_dtype(tiny_target(vocab=32, layers=2, hidden=32).model, sizes=(1, 4), context=8,
                                   repeats=1)
    assert alone == torch.bfloat16 and all(b == 1 for _, b, _ in seen)
    seen.clear()
    served, costs = timing.choose_dtype(tiny_target(vocab=32, layers=2, hidden=32).model, sizes=(1, 4), context=8,
                                        repeats=1, batch=4)
    # +5 s for the batch against +2 s for the single trees: 3 s apart, up to the real timings
    assert served == torch.float32 and costs["bfloat16"] > costs["float32"] + 2.5
    assert ("torch.float32", 4, 1) in seen and ("torch.bfloat16", 4, 1) in seen


def test_reserve_slots_grows_the_pool_once_and_never_shrinks_it():
    eng = Engine(tiny_target(), None, make_controller("ar"))
    assert eng.pool.num_slots == 1
    eng.reserve_slots(4)
    assert eng.pool.num_slots == 4 and eng.pool.free_slots == 4
    eng.reserve_slots(2)
    assert eng.pool.num_slots == 4
    seqs = [eng.start([1, 2, 3], SamplingParams(max_tokens=2)) for _ in range(4)]
    assert eng.pool.num_slots == 4 and eng.pool.free_slots == 0  # no grow while four run
    for s in seqs:
        eng.release(s)


def test_auto_dtype_is_measured_once_and_kept_for_later_starts(monkeypatch, tmp_path):
    """dtype 'auto' keeps its first measured choice in the cache directory: a later start on the
    same machine reads it back (no timing, same dtype); another target or machine measures anew."""
    import engine.loader as loader
    import engine.timing as timing

    monkeypatch.setenv("BASTION_CACHE", str(tmp_path))
    calls = []
    real = timing.choose_dtype

    def counted(model, **kw):
        calls.append(1)
        return real(model, sizes=(1,), context=8, repeats=1)

    def slower_in_float32(model, *args, **kwargs):
        measure = real_timer(model, *args, **kwargs)
        return lambda b, s, c: measure(b, s, c) + (1.0 if model.dtype == torch.float32 else 0.0)

    real_timer = timing.batch_verify_timer
    monkeypatch.setattr(timing, "choose_dtype", counted)
    monkeypatch.setattr(timing, "batch_verify_timer", slower_in_float32)
    first = tiny_target(vocab=32, layers=2, hidden=32)
    dtype, costs = loader.auto_dtype(first.model, "tiny", (1,), 1, "cpu A (2 cores)")
    assert dtype == torch.bfloat16 and first.model.dtype == torch.bfloat16 and len(calls) == 1
    assert len(list((tmp_path / "dtype").glob("tiny-*.json"))) == 1
    monkeypatch.setattr(timing, "batch_verify_timer", real_timer)  # a second measurement could differ
    later = tiny_target(vocab=32, layers=2, hidden=32)
    again, kept = loader.auto_dtype(later.model, "tiny", (1,), 1, "cpu A (2 cores)")
    assert again == torch.bfloat16 and later.model.dtype == torch.bfloat16 and kept == costs
    assert len(calls) == 1  # read back, not measured
    loader.auto_dtype(tiny_target(vocab=32, layers=2, hidden=32).model, "other", (1,), 1, "cpu A (2 cores)")
    assert len(calls) == 2
    loader.auto_dtype(tiny_target(vocab=32, layers=2, hidden=32).model, "tiny", (1,), 1, "cpu B (2 cores)")
    assert len(calls) == 3  # another machine measures anew
    loader.auto_dtype(tiny_target(vocab=32, layers=2, hidden=32).model, "tiny", (1,), 1)
    assert len(calls) == 4  # without the machine's identity nothing is kept


def test_positions_never_written_hold_zeros_even_in_reused_memory():
    """One attention call for several decode rows reads each slot past its length and masks it
    (engine.attention.DecodeBatch): a NaN left there by freed memory would poison the row."""
    for _ in range(3):  # leave NaN-filled blocks of the pool's size for the allocator to hand back
        torch.full((2, 3, 2, 40, 8), float("nan"))
    pool = KVPool(2, 3, 2, 40, 8, torch.float32, "cpu")
    assert pool.keys.abs().sum().item() == 0 and pool.values.abs().sum().item() == 0
    pool.grow(5)
    assert torch.isfinite(pool.keys).all() and pool.keys[:, 3:].abs().sum().item() == 0
