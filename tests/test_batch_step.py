"""Several sequences verified in one forward (Engine.step_batch): each output equals the sequence
served alone, with sequences joining, leaving and being cancelled mid-run; seeded sampling is
reproducible whatever runs beside it."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from helpers import OracleDrafter, tiny_target

VOCAB = 64
PROMPTS = [[3, 5, 7], [11, 2, 9, 4, 4], [8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
N = 24


class PromptOracle(OracleDrafter):
    """OracleDrafter for many sequences at once: each state follows the reference of its own prompt."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], **kwargs):
        super().__init__([], VOCAB, **kwargs)
        self.references = references

    def new_state(self):
        return {"n": 0, "ref": None, "seen": []}

    def extend(self, state, token_ids, features):
        if state["ref"] is None:  # the prompt may come in chunks: no test prompt is a prefix of another
            state["seen"] += list(token_ids)
            state["ref"] = self.references.get(tuple(state["seen"]))
        state["n"] += len(token_ids)

    def propose(self, state, root, max_depth):
        self.reference = state["ref"]
        return super().propose(state, root, max_depth)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab=VOCAB, layers=2, hidden=64)


@pytest.fixture(scope="module")
def alone(target):
    eng = Engine(target)
    return [eng.generate(p, SamplingParams(max_tokens=N)).token_ids for p in PROMPTS]


def run_batched(eng: Engine, params: list[SamplingParams], join_after: int = 2, cancel: int | None = None):
    """Start the first half, step them, let the rest join after `join_after` steps; cancel one if asked."""
    half = len(PROMPTS) // 2
    seqs = {i: eng.start(PROMPTS[i], params[i]) for i in range(half)}
    outs = {i: list(seqs[i].pending.token_ids) for i in seqs}
    steps = 0
    run_batched.longest_step = 0
    while seqs:
        if steps == join_after:
            for i in range(half, len(PROMPTS)):
                seqs[i] = eng.start(PROMPTS[i], params[i])
                outs[i] = list(seqs[i].pending.token_ids)
        if cancel is not None and steps == join_after + 1 and cancel in seqs:
            eng.release(seqs.pop(cancel))
        order = sorted(seqs)
        for i, ev in zip(order, eng.step_batch([seqs[i] for i in order])):
            outs[i].extend(ev.token_ids)
            run_batched.longest_step = max(run_batched.longest_step, len(ev.token_ids))
            if ev.finish_reason is not None:
                del seqs[i]
        steps += 1
    return outs


def step_all(eng: Engine, seqs: dict) -> tuple[dict, dict]:
    """Step the started sequences together until each finishes or fails: (outputs, errors) by key."""
    outs = {i: list(s.pending.token_ids) for i, s in seqs.items()}
    errors = {}
    while seqs:
        order = sorted(seqs)
        for i, out in zip(order, eng.step_batch([seqs[i] for i in order])):
            if isinstance(out, Exception):
                errors[i] = out
                del seqs[i]
                continue
            outs[i].extend(out.token_ids)
            if out.finish_reason is not None:
                del seqs[i]
    return outs, errors


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("chain", 16), ("tree", 16)])
def test_each_output_in_a_batch_equals_it_served_alone(target, alone, mode, budget):
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}
    drafter = None if mode == "ar" else PromptOracle(refs, decoy_every=3)
    eng = Engine(target, drafter, make_controller(mode, budget))
    outs = run_batched(eng, [SamplingParams(max_tokens=N) for _ in PROMPTS])
    assert [outs[i] for i in range(len(PROMPTS))] == alone
    assert eng.pool.free_slots == eng.pool.num_slots
    assert (run_batched.longest_step >= 3) == (mode != "ar")  # drafts were accepted (a chain stops at decoys)


def test_a_cancelled_sequence_does_not_disturb_the_others(target, alone):
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}
    eng = Engine(target, PromptOracle(refs, decoy_every=2), make_controller("tree", 8))
    outs = run_batched(eng, [SamplingParams(max_tokens=N) for _ in PROMPTS], cancel=0)
    assert all(outs[i] == alone[i] for i in range(1, len(PROMPTS)))
    assert outs[0] == alone[0][: len(outs[0])] and len(outs[0]) < N
    assert eng.pool.free_slots == eng.pool.num_slots


def test_seeded_sampling_is_reproducible_beside_other_requests(target):
    eng = Engine(target)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=N)
    ref = eng.generate(PROMPTS[2], sampled).token_ids
    params = [SamplingParams(max_tokens=N), SamplingParams(temperature=0.8, seed=1, max_tokens=N), sampled,
              SamplingParams(temperature=1.0, seed=99, max_tokens=N)]
    outs = run_batched(eng, params, join_after=0)
    assert outs[2] == ref
    assert outs[1] != outs[3]  # different seeds, different samples


def test_a_sequence_twice_in_one_batch_is_refused(target):
    eng = Engine(target)
    seq = eng.start(PROMPTS[0], SamplingParams(max_tokens=N))
    with pytest.raises(ValueError, match="distinct running"):
        eng.step_batch([seq, seq])
    eng.release(seq)


def test_a_sequence_whose_drafter_fails_is_dropped_and_the_others_go_on(target, alone):
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}

    class FailsForOnePrompt(PromptOracle):
        def propose(self, state, root, max_depth):
            if state["ref"][: len(PROMPTS[1])] == PROMPTS[1] and state["n"] > len(PROMPTS[1]) + 3:
                raise RuntimeError("drafter bug")
            return super().propose(state, root, max_depth)

    eng = Engine(target, FailsForOnePrompt(refs, decoy_every=3), make_controller("tree", 8))
    seqs = {i: eng.start(p, SamplingParams(max_tokens=N)) for i, p in enumerate(PROMPTS)}
    outs, errors = step_all(eng, seqs)
    assert set(errors) == {1} and "drafter bug" in str(errors[1])
    assert all(outs[i] == alone[i] for i in (0, 2, 3))
    assert eng.pool.free_slots == eng.pool.num_slots  # the failed sequence's slot came back too


PROMPTS8 = PROMPTS + [[6, 6, 6], [9, 1], [2, 4, 8, 16 % VOCAB], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def alone8(target):
    eng = Engine(target)
    return [eng.generate(p, SamplingParams(max_tokens=N)).token_ids for p in PROMPTS8]


def _bastion_controller(arms=None):
    """The adaptive controller on a synthetic memory-bound machine; arms: restrict its gates
    (("draft",): the full drafter on every step)."""
    from prometheus_client import CollectorRegistry

    from controller.budget import BudgetController
    from controller.gate import SpeculationGate
    from controller.ceilings import Ceilings
    from controller.cost_model import ModelShape
    from controller.latency_model import LatencyModel, LatencyParams
    from controller.policy import PolicySettings

    # A memory-bound machine (flat C(n) up to ~32 tokens): the global budget grows real trees.
    shape = ModelShape(layers=2, hidden=64, n_q=4, n_kv=4, head_dim=16, ffn=128, vocab=VOCAB, bytes_per_param=4)
    model = LatencyModel(shape, Ceilings(1e9, 1e9, "synthetic"), LatencyParams(1.0, 1e-3, 1.0, 5e-3))
    return BudgetController(model, PolicySettings(1, 64, 1, 8), registry=CollectorRegistry(), t_draft_init=1e-3,
                            gate=SpeculationGate(arms=arms) if arms else None)


@pytest.mark.parametrize("wave", [1, 3, 8])
def test_bastion_batches_of_one_to_eight_equal_each_request_alone(target, alone8, wave):
    """The adaptive controller's global budget: requests start in waves of `wave` (joining while the
    earlier ones run, leaving as they finish); every output equals the request served alone."""
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS8, alone8)}
    ctl = _bastion_controller()
    eng = Engine(target, PromptOracle(refs, decoy_every=3), ctl)
    pending = list(range(len(PROMPTS8)))
    seqs, outs, sizes = {}, {}, []
    while pending or seqs:
        for i in pending[:wave]:
            seqs[i] = eng.start(PROMPTS8[i], SamplingParams(max_tokens=N))
            outs[i] = list(seqs[i].pending.token_ids)
        pending = pending[wave:]
        order = sorted(seqs)
        events = eng.step_batch([seqs[i] for i in order])
        sizes.append([ev.step.tree_size for ev in events])
        for i, ev in zip(order, events):
            outs[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                del seqs[i]
    assert [outs[i] for i in range(len(PROMPTS8))] == alone8
    assert eng.pool.free_slots == eng.pool.num_slots
    # Trees were grown in batched steps, under the global budget, and the controller saw them.
    assert any(len(s) > 1 and max(s) > 1 for s in sizes)
    assert ctl.batch_steps == sum(len(s) > 1 for s in sizes) > 0


def test_batched_dflash_pass_equals_one_pass_per_request(target_f32, random_drafter):
    """One drafter forward over several requests' blocks gives each the marginals of its own pass."""
    eng = Engine(target_f32, random_drafter, make_controller("tree", 8))
    prompts = [eng.chat_prompt_ids([{"role": "user", "content": t}]) for t in ("Hi there", "Count to five", "Why?")]
    singles, batched = [], []
    for out in (singles, batched):
        seqs = [eng.start(p, SamplingParams(max_tokens=8)) for p in prompts]
        for _ in range(2):  # a first step gives every state some committed context beyond the prompt
            eng.step_batch(seqs)
        states = [s.drafter_state for s in seqs]
        if out is singles:
            out.extend(random_drafter.propose(st, s.root, 15) for st, s in zip(states, seqs))
        else:
            out.extend(random_drafter.propose_batch(states, [s.root for s in seqs], [15, 7, 15]))
        for s in seqs:
            eng.release(s)
    for a, b, depth in zip(singles, batched, (15, 7, 15)):
        assert b.token_ids.shape[0] == depth
        torch.testing.assert_close(b.logprobs, a.logprobs[:depth], atol=1e-4, rtol=1e-4)
        assert (b.token_ids[:, :4] == a.token_ids[:depth, :4]).float().mean() > 0.95


def test_chunked_prefill_beside_running_sequences_equals_alone(target, alone):
    """A prompt prefilled 3 tokens at a time by prefill_step, between steps of another sequence,
    decodes exactly as when started in one go; step_batch refuses it until it is prefilled."""
    eng = Engine(target)
    other = eng.start(PROMPTS[0], SamplingParams(max_tokens=N))
    outs = {0: list(other.pending.token_ids), 3: []}
    seq = eng.begin(PROMPTS[3], SamplingParams(max_tokens=N))
    with pytest.raises(ValueError, match="prefill"):
        eng.step_batch([other, seq])
    chunks = 0
    while (ev := eng.prefill_step(seq, 3)) is None:
        chunks += 1
        outs[0].extend(eng.step(other).token_ids)
    assert chunks == 3 and seq.prefix_len == len(PROMPTS[3])  # 10 tokens: 3 + 3 + 3, then the last 1
    outs[3].extend(ev.token_ids)
    with pytest.raises(ValueError, match="prefilling"):
        eng.prefill_step(seq, 3)
    live = {0: other, 3: seq}
    while live:
        order = sorted(live)
        for i, ev in zip(order, eng.step_batch([live[i] for i in order])):
            outs[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                del live[i]
    assert outs[0] == alone[0] and outs[3] == alone[3]
    assert eng.pool.free_slots == eng.pool.num_slots


@pytest.mark.parametrize("mode,budget", [("ar", 1), ("tree", 8)])
def test_prompt_chunks_inside_decoding_steps_equal_alone(target, alone, mode, budget):
    """Prompts prefilled 3 tokens at a time inside the running sequences' steps (step_mixed: one
    forward for the trees and the chunks) decode exactly as when each is served alone."""
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}
    drafter = None if mode == "ar" else PromptOracle(refs, decoy_every=3)
    eng = Engine(target, drafter, make_controller(mode, budget))
    live = {i: eng.start(PROMPTS[i], SamplingParams(max_tokens=N)) for i in (0, 2)}
    outs = {i: list(s.pending.token_ids) for i, s in live.items()}
    filling = {i: eng.begin(PROMPTS[i], SamplingParams(max_tokens=N)) for i in (1, 3)}
    mixed_steps = 0
    while live or filling:
        order, pre = sorted(live), sorted(filling)
        events, firsts = eng.step_mixed([live[i] for i in order], [(filling[i], 3) for i in pre])
        mixed_steps += bool(order and pre)
        for i, ev in zip(order, events):
            outs[i].extend(ev.token_ids)
            if ev.finish_reason is not None:
                del live[i]
        for i, ev in zip(pre, firsts):
            if ev is not None:  # prompt done: the first token, and the sequence decodes from the next step
                outs[i] = list(ev.token_ids)
                live[i] = filling.pop(i)
    assert mixed_steps >= 3  # PROMPTS[3] (10 tokens) took 4 chunks, all beside running sequences
    assert [outs[i] for i in range(len(PROMPTS))] == alone
    assert eng.pool.free_slots == eng.pool.num_slots


def test_several_prompts_prefilled_in_one_forward_equal_alone(target, alone):
    """step_mixed with no running sequence prefills several prompts in one forward."""
    eng = Engine(target)
    seqs = {i: eng.begin(p, SamplingParams(max_tokens=N)) for i, p in enumerate(PROMPTS)}
    events, firsts = eng.step_mixed([], [(seqs[i], 64) for i in sorted(seqs)])
    assert events == [] and all(ev is not None for ev in firsts)
    outs, errors = step_all(eng, seqs)
    assert not errors and [outs[i] for i in range(len(PROMPTS))] == alone
    with pytest.raises(ValueError, match="distinct"):
        seq = eng.begin(PROMPTS[0], SamplingParams(max_tokens=N))
        eng.step_mixed([], [(seq, 2), (seq, 2)])
    eng.release(seq)
    assert eng.pool.free_slots == eng.pool.num_slots


def test_a_prompt_chunk_that_fails_fails_only_its_sequence(target, alone):
    """A drafter that fails on one prompt's chunk inside a step: that sequence gets its error and
    its slot back; the running sequences' outputs are exact."""
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}

    class FailsOnAPrompt(PromptOracle):
        def extend(self, state, token_ids, features):
            if list(token_ids[:2]) == PROMPTS[1][:2]:
                raise RuntimeError("drafter bug")
            super().extend(state, token_ids, features)

    eng = Engine(target, FailsOnAPrompt(refs, decoy_every=3), make_controller("tree", 8))
    live = {0: eng.start(PROMPTS[0], SamplingParams(max_tokens=N))}
    first = list(live[0].pending.token_ids)
    bad = eng.begin(PROMPTS[1], SamplingParams(max_tokens=N))
    events, firsts = eng.step_mixed([live[0]], [(bad, 4)])
    assert isinstance(firsts[0], RuntimeError) and "drafter bug" in str(firsts[0]) and bad.slot < 0
    outs, errors = step_all(eng, live)  # starts from the pending first token again
    assert not errors
    assert first + events[0].token_ids + outs[0][len(first):] == alone[0]
    assert eng.pool.free_slots == eng.pool.num_slots


def test_the_controller_sees_a_lone_requests_state_and_no_step_that_carries_a_prompt(target, alone):
    """A sequence alone passes its own controller state to every decision and to `observe`; in a
    batch no state goes to the single-step calls; a step whose forward carries a prompt chunk is
    recorded by the step accounting (without its time) but not shown to the controller."""
    from engine.engine import FixedController

    class Recording(FixedController):
        def __init__(self):
            super().__init__(make_controller("tree", 8).policy)
            self.calls, self.observed = [], []

        def sequence_state(self):
            return object()

        def should_draft(self, batch_size=1, state=None):
            self.calls.append(("should_draft", batch_size, state))
            return True

        def policy_for_step(self, context_len, state=None):
            self.calls.append(("policy", 1, state))
            return super().policy_for_step(context_len, state)

        def observe(self, stats, tree, state=None):
            self.observed.append((stats, state))

        def observe_batch(self, stats, trees, states=None):
            self.observed.append((stats, states))

    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS, alone)}
    ctl = Recording()
    eng = Engine(target, PromptOracle(refs, decoy_every=3), ctl)
    a = eng.start(PROMPTS[0], SamplingParams(max_tokens=N))
    eng.step(a)
    assert ctl.calls and all(state is a.control for _, _, state in ctl.calls)
    assert len(ctl.observed) == 1 and ctl.observed[0][1] is a.control
    b = eng.start(PROMPTS[1], SamplingParams(max_tokens=N))
    ctl.calls.clear()
    eng.step_batch([a, b])
    assert ctl.calls and all(state is None for _, _, state in ctl.calls)
    assert len(ctl.observed) == 2 and ctl.observed[1][1] == [a.control, b.control]
    c = eng.begin(PROMPTS[3], SamplingParams(max_tokens=N))
    seconds_before = eng.accounting.snapshot()._seconds
    steps_before = eng.accounting.steps
    events, firsts = eng.step_mixed([a, b], [(c, 4)])
    assert firsts == [None] and all(ev.step.prompt_tokens == 4 for ev in events)
    assert len(ctl.observed) == 2  # not shown to the controller
    after = eng.accounting.snapshot()
    assert after.steps == steps_before + 2 and after._seconds <= seconds_before  # counted, its time left out
    for s in (a, b, c):
        eng.release(s)


def test_a_failed_shared_step_releases_the_prompt_chunks_sequences(target, monkeypatch):
    """When the forward of a step with prompt chunks fails, the error is raised and no chunk's
    sequence keeps its slot (nothing is left half-prefilled); the running sequence is intact."""
    import engine.engine as engine_mod

    eng = Engine(target)
    a = eng.start(PROMPTS[0], SamplingParams(max_tokens=N))
    c = eng.begin(PROMPTS[3], SamplingParams(max_tokens=N))

    def broken(*args, **kwargs):
        raise RuntimeError("the forward ran out of memory")

    monkeypatch.setattr(engine_mod, "verify_and_prefill", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        eng.step_mixed([a], [(c, 4)])
    assert c.slot < 0 and a.slot >= 0 and a.finish_reason is None
    monkeypatch.undo()
    eng.step(a)  # the running sequence steps on
    eng.release(a)
    assert eng.pool.free_slots == eng.pool.num_slots


def test_a_proposal_that_fails_inside_the_global_heap_fails_only_its_sequence(target, alone8):
    """Under the global budget a proposal is read inside the shared heap; when one raises there,
    the trees are rebuilt alone, that sequence gets its error and the others their exact output."""
    refs = {tuple(p): p + out + [0] * 16 for p, out in zip(PROMPTS8, alone8)}

    class Broken:
        def source(self, top_k):
            raise RuntimeError("broken proposal")

    class BreaksForOnePrompt(PromptOracle):
        def propose(self, state, root, max_depth):
            if state["ref"][: len(PROMPTS8[2])] == PROMPTS8[2] and state["n"] > len(PROMPTS8[2]) + 2:
                return Broken()
            return super().propose(state, root, max_depth)

    # Every step drafts, so the broken proposal is read inside the shared heap: the controller's
    # gate has the draft arm alone, and so has every request's own (BudgetController.sequence_state;
    # with a plain arm, measured step times on a busy machine kept the request out of every draft).
    ctl = _bastion_controller(arms=("draft",))
    eng = Engine(target, BreaksForOnePrompt(refs, decoy_every=3), ctl)
    seqs = {i: eng.start(p, SamplingParams(max_tokens=N)) for i, p in enumerate(PROMPTS8[:4])}
    outs, errors = step_all(eng, seqs)
    assert set(errors) == {2} and "broken proposal" in str(errors[2])
    assert all(outs[i] == alone8[i] for i in (0, 1, 3))
    assert eng.pool.free_slots == eng.pool.num_slots
