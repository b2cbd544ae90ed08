"""Exactness at temperature 0 with the suffix drafter and the DFlash + suffix hybrid.

Real prompts on the embedded default, several of them repetition-heavy so the suffix
index proposes long accepted paths; every speculative output must equal engine AR.
"""
from __future__ import annotations

import pytest

from drafting.hybrid import DEFAULT_MERGE, MERGES, HybridDrafter
from drafting.suffix import SuffixDrafter
from engine.engine import Engine, FixedController, make_controller
from engine.sampling import SamplingParams
from helpers import ar_references

PROMPTS = [
    "Repeat this sentence exactly three times: The quick brown fox jumps over the lazy dog.",
    "Add type hints to this function and return it:\n\ndef add(a, b):\n    return a + b",
    "Fix the bug in this code:\n\ndef is_even(n):\n    return n % 2 == 1",
    "Write the numbers from one to ten in words, separated by commas.",
    "What is the capital of Australia?",
    "Write a haiku about the sea.",
]
MAX_TOKENS = 32
MODES = [("tree", 16), ("chain", 16)]


@pytest.fixture(scope="module")
def references(target_f32):
    """Per prompt: (prompt ids, engine AR output ids)."""
    return ar_references(target_f32, PROMPTS, MAX_TOKENS)


def _check(target, drafter, references, modes=MODES):
    taus = []
    for mode, budget in modes:
        eng = Engine(target, drafter, make_controller(mode, budget, drafter.max_depth + 1))
        for ids, ref in references:
            r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
            assert r.token_ids == ref, (mode, budget, ids)
            assert all(s.tree_size <= budget for s in r.steps)
            taus.append(r.tau)
    return taus


def test_suffix_drafter_equals_ar(target_f32, references):
    d = SuffixDrafter(global_tokens=4096)  # the global index fills as requests finish
    taus = _check(target_f32, d, references)
    assert len(d.global_index) == 2 * len(PROMPTS)
    assert max(taus) > 2  # repetition-heavy prompts accept long paths


def test_hybrid_equals_ar(target_f32, random_drafter, references):
    """The default merge, every prompt, tree and chain (the random DFlash costs about a
    target forward per step on a CPU, so the other merges get fewer prompts below)."""
    h = HybridDrafter(random_drafter, SuffixDrafter())
    taus = _check(target_f32, h, references)
    assert max(taus) > 2


@pytest.mark.parametrize("merge", [m for m in MERGES if m != DEFAULT_MERGE])
def test_other_merges_equal_ar(target_f32, random_drafter, references, merge):
    h = HybridDrafter(random_drafter, SuffixDrafter(), merge=merge)
    taus = _check(target_f32, h, references[:3], MODES[:1])
    assert max(taus) > 1.5


class _CountingHybrid(HybridDrafter):
    skipped = 0

    def propose_batch(self, states, roots, max_depths):
        before = sum(st.skipped for st in states)
        out = super().propose_batch(states, roots, max_depths)
        self.skipped += sum(st.skipped for st in states) - before
        return out


def test_hybrid_skipping_dflash_equals_ar(target_f32, random_drafter, references):
    h = _CountingHybrid(random_drafter, SuffixDrafter(), skip_dflash_match=2)
    _check(target_f32, h, references[:2], MODES[:1])
    assert h.skipped > 0


def _finished_output(target, drafter, suffix, ids):
    eng = Engine(target, drafter, make_controller("tree", 16))
    r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
    g = suffix.global_index
    assert len(g) == 1
    return r.token_ids, g.tokens(g.request_ids()[0])


def _drafters(random_drafter):
    s1, s2 = SuffixDrafter(global_tokens=1000), SuffixDrafter(global_tokens=1000)
    return [(s1, s1), (HybridDrafter(random_drafter, s2), s2)]


def test_engine_finish_feeds_the_global_index(target_f32, random_drafter, references):
    """The engine calls finish() at request end and the output lands in the global index,
    through the hybrid too (the last step's root included)."""
    ids, ref = references[0]
    for drafter, suffix in _drafters(random_drafter):
        out, stored = _finished_output(target_f32, drafter, suffix, ids)
        assert out == ref
        assert len(stored) >= len(ref) - 1
        it = iter(ref)
        assert all(t in it for t in stored)  # a subsequence of the output


def test_engine_finish_passes_the_whole_output(target_f32, random_drafter, references):
    ids, ref = references[0]
    for drafter, suffix in _drafters(random_drafter):
        out, stored = _finished_output(target_f32, drafter, suffix, ids)
        assert stored == out


class _GateOff(FixedController):
    """A controller whose gate keeps the full drafter off: only free proposals are verified."""

    def __init__(self, budget):
        super().__init__(make_controller("tree", budget).policy)
        self.corrected: list[bool] = []  # the `cheap` flag of every correction asked for

    def should_draft(self, batch_size=1, state=None):
        return False

    def correct(self, proposal, cheap=False):
        self.corrected.append(cheap)  # the free proposal must reach its own calibrator
        return proposal


def test_gate_off_steps_verify_the_free_suffix_tree_and_stay_exact(target_f32, random_drafter, references):
    """With the full drafter gated off, the hybrid's suffix tree alone (propose_cheap) is verified:
    DFlash never runs, repetition still gets accepted, the output equals AR."""
    calls = []

    class Counting(HybridDrafter):
        def propose_batch(self, *a, **kw):
            calls.append(1)
            return super().propose_batch(*a, **kw)

    h = Counting(random_drafter, SuffixDrafter())
    gate_off = _GateOff(16)
    eng = Engine(target_f32, h, gate_off)
    cheap_accepted = []
    for ids, ref in references:
        r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert r.token_ids == ref
        for s in r.steps:
            assert not s.drafted and s.cheap == (s.tree_size > 1)
            if s.cheap:
                cheap_accepted.append(s.accepted)
    assert calls == []
    assert cheap_accepted and max(cheap_accepted) > 2
    assert gate_off.corrected and all(gate_off.corrected)


class _FreeFirst(FixedController):
    """A controller that drafts every step but takes the free tree instead whenever it has at
    least `min_nodes` nodes (what `BudgetController.free_suffices` decides from costs)."""

    def __init__(self, budget, min_nodes):
        super().__init__(make_controller("tree", budget).policy)
        self.min_nodes = min_nodes
        self.asked = 0
        self.corrected: list[bool] = []

    def correct(self, proposal, cheap=False):
        self.corrected.append(cheap)
        return proposal

    def free_first(self, context_len, state=None):
        self.asked += 1
        return self.policy

    def free_suffices(self, tree, context_len, state=None):
        return tree.size >= self.min_nodes


def test_free_tree_run_in_the_drafts_place_skips_the_drafter_and_stays_exact(target_f32, random_drafter,
                                                                              references):
    """A step that would draft first builds the free (suffix) tree; where the controller finds it
    enough the drafter's pass is skipped and that tree is verified, once corrected as a free
    proposal; elsewhere the full draft runs. The output equals AR either way."""
    calls = []

    class Counting(HybridDrafter):
        def propose_batch(self, *a, **kw):
            calls.append(1)
            return super().propose_batch(*a, **kw)

    ctl = _FreeFirst(16, min_nodes=3)
    eng = Engine(target_f32, Counting(random_drafter, SuffixDrafter()), ctl)
    free_steps = drafted_steps = 0
    for ids, ref in references:
        r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert r.token_ids == ref
        for s in r.steps:
            assert not (s.drafted and s.cheap)
            free_steps += s.cheap
            drafted_steps += s.drafted
            if s.cheap:
                assert s.tree_size >= 3
    assert free_steps > 0 and drafted_steps > 0
    assert len(calls) == drafted_steps  # the drafter ran exactly on the steps that drafted
    # every free proposal built was corrected once, as free; every full draft once, as not free
    assert ctl.corrected.count(False) == drafted_steps and ctl.corrected.count(True) >= free_steps


class _EmptyToDraft(_GateOff):
    """A gate that keeps the full drafter off, except on a step whose free proposal came back
    empty: there it asks for the full draft (what `BudgetController.free_empty` does when the
    draft's average beats plain decoding)."""

    def __init__(self, budget):
        super().__init__(budget)
        self.switch = False
        self.empties = 0

    def should_draft(self, batch_size=1, state=None):
        return self.switch

    def free_empty(self, state=None):
        self.empties += 1
        self.switch = True
        return True

    def observe(self, stats, tree, state=None):
        self.switch = False


def test_an_empty_free_proposal_turns_the_step_into_a_full_draft_and_stays_exact(target_f32, random_drafter,
                                                                                 references):
    """Where the suffix index has nothing to propose, a free-proposal step runs the full drafter
    instead (corrected as a full draft); where it has a match, the free tree is verified. The
    output equals AR either way, and no step is left plain while a proposal could be made."""
    calls = []

    class Counting(HybridDrafter):
        def propose_batch(self, *a, **kw):
            calls.append(1)
            return super().propose_batch(*a, **kw)

    ctl = _EmptyToDraft(16)
    eng = Engine(target_f32, Counting(random_drafter, SuffixDrafter()), ctl)
    drafted = cheap = 0
    for ids, ref in references:
        r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert r.token_ids == ref
        for i, s in enumerate(r.steps):
            if i < len(r.steps) - 1:  # the last step may have room for one token only
                assert s.drafted != s.cheap and s.tree_size > 1
            drafted += s.drafted
            cheap += s.cheap
    assert drafted == len(calls) == ctl.empties > 0 and cheap > 0
    assert ctl.corrected.count(False) == drafted  # the drafts reached the full drafter's calibrator
