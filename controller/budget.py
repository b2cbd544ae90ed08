"""The budget controller: the engine's adaptive StepController (mode `bastion`).

Per step the engine asks, in order (engine/engine.py, `Engine._plan_batch`):
    if controller.should_draft(b):
        proposal = controller.correct(drafter.propose(...))   # identity unless correction is on
    elif controller.allow_cheap(b):                           # the drafter's free part, or None
        proposal = controller.correct(drafter.propose_cheap(...), cheap=True)
    tree = build_tree(root, proposal, controller.policy_for_step(c), max_depth)
    # b >= 2 sequences: build_trees(roots, proposals, controller.batch_policy(contexts), ...)
    ... verify, accept, compact ...
    controller.observe(stats, tree)                           # or observe_batch(stats, trees)

b is the number of sequences in the step: one gate per batch-size class chooses among the
full drafter, its free part and plain decoding (controller/gate.py) by their realised tokens
per second over a plain step's, measured: the median ratio of recent plain steps' times to the
latency model's C(1) scales the model's prediction at the step's context.

`observe` feeds the online profiler, the gate and the surrogate checks (`record_step`; one
for full drafts, one for free proposals),
then exports the controller's own gauges. Step figures every mode shares (speedup, tree
sizes, accepted lengths) are the engine's step accounting (engine/accounting.py), not here.
The method is described in docs/method.md, sections 8 and 9.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from controller.calibration import BatchMeasureFn, CalibrationGrid, CalibrationResult, MeasureFn, calibrate
from controller.gate import SpeculationGate
from controller.latency_model import LatencyModel
from controller.metrics import TABLE_S, controller_metrics
from controller.policy import AdaptivePolicy, BatchAdaptivePolicy, PolicySettings, default_settings
from controller.profiler import OnlineProfiler, RunningMean
from controller.sizing import RealisedSizes
from controller.surrogate import SurrogateCalibrator, depth_mass
from drafting.proposal import Proposal

log = logging.getLogger(__name__)


#: A plain step's policy: the root alone (engine/engine.py drafts nothing for a one-node cap).
_PLAIN_POLICY = AdaptivePolicy([0.0, 0.0], 0.0, 1, 1)


@dataclass
class RequestGates:
    """One request's own gates, kept in its engine Sequence (`BudgetController.sequence_state`).

    batch: arms draft and plain (those of them the controller's gate has: a controller that
    always drafts leaves no request out), judged by the request's marginal gain inside batched
    steps (docs/method.md, section 9). solo: the shared gate's arms (draft, cheap and plain when
    serving) for the steps it runs alone, created at its first such step from the controller's
    shared gate, whose averages count as gate.INHERIT_SAMPLES samples each (docs/method.md, section 8):
    a prompt on which an arm stops paying turns it down within a few of its own steps, while the
    shared gate, which every request's steps feed at weight SHARED_ALPHA, keeps what holds
    across requests.
    """

    batch: SpeculationGate
    solo: SpeculationGate | None = None


#: The cost table C(n, c) is computed once per this many tokens of context (its start), not
#: every step: 16 tokens move a 135M target's C(1) by well under 1 %, and the table cost 0.3 ms a
#: step to compute (docs/controller.md, "The cost of the controller itself").
COST_CONTEXT_STEP = 16

#: Weight of one request's step in the shared gate's averages when the request's own gate decided
#: it: the shared gate is what holds across requests (the machine, the drafter), so one hard
#: prompt moves it a third as fast as it moves the request's own gate (about 20 samples of memory).
SHARED_ALPHA = 0.05

#: In batched steps of three or four sequences a speculative arm must beat plain decoding by this
#: factor (`batch_bar`; batches of two: PAIR_SPECULATION_BAR, of five or more:
#: WIDE_SPECULATION_BAR): the
#: step's clock misses what speculation costs a batch beyond its own steps. Requests that speculate
#: finish at different steps, so their successors' prompts are prefilled one at a time inside decode
#: steps and the last requests run in smaller batches. Measured at 8 clients (avx512_bf16 EPYC,
#: float32): bastion's 8-sequence steps ran at 0.96-0.97 of batched AR's, its cells at 0.92
#: (docs/controller.md, "A stale plain baseline, the batched bar, and refits that stall").
BATCH_SPECULATION_BAR = 1.1

#: The bar of batches of two (`batch_bar`): with two sequences the desynchronised tail costs
#: little, and at 2 clients the 1.1 bar left bastion at 0.92 of tree-4 in 2 passes of 3 (3.7-4.4
#: nodes a forward against tree-4's 7.0). In an interleaved A/B at 2 clients (avx512_bf16 EPYC,
#: float32, 4 passes; scripts/batch_bar_ab.py) a bar of 1.0 for this class ran at 38.3 tok/s
#: (tree-4 38.3, the 1.1 bar 36.0), and in the next full concurrency run bastion was the best mode
#: at 2 clients (1.06 of batched AR; docs/controller.md, "The bar of batches of two").
PAIR_SPECULATION_BAR = 1.0

#: The bar of batches of five or more (`batch_bar`): the more sequences, the more a request that
#: finishes early costs (its successor's prompt is prefilled alone inside a decode step, and the
#: last requests run in ever smaller batches). At the 1.1 bar the class gate of 5-8 sequences gave
#: 10-35 % of its steps to free proposals that read 0.99-1.14 (a near-tie: sampled every MIN_PERIOD
#: steps, and at once after each sample above the bar), and bastion ran at 0.89-0.95 of batched AR
#: at 8 clients. Interleaved A/Bs at 8 clients (avx512_bf16 EPYC, float32; `scripts/batch_bar_ab.py
#: 8 5 1.3 --class 8`, then 8 passes with `--tree 0`): a bar of 1.3 ran at 73.5 and 66.6 tok/s
#: (medians) against 70.7 and 60.8 for 1.1 and 69.2 and 64.0 for batched AR; paired over the 13
#: passes, 1.07 of the 1.1 bar (docs/controller.md, "A higher bar for five or more").
WIDE_SPECULATION_BAR = 1.3

#: The measured plain baseline (`plain_step_seconds`) is the median of the plain steps of the last
#: PLAIN_MAX_AGE steps (single and batched counted together); when a batch size has had no plain
#: step for PLAIN_REFRESH steps, its next step is plain (`refresh_plain`), so four or more are in
#: the median. A refresh costs a speculative step's extra tokens once per PLAIN_REFRESH steps: under
#: 1 % of the throughput where drafting runs 1.5x plain decoding (at 32 steps, a simulated 2x
#: drafter lost a fifth of its drafted steps to refreshes and exploration together,
#: tests/test_controller_robust.py). With plain steps timed during a busy start-up (bfloat16,
#: avx512_bf16 EPYC), the baseline was back at the quiet machine's within 2-3 requests at 256 / 48,
#: where without an age limit it stayed 1.6-2x high for 6 requests of 6.
PLAIN_MAX_AGE = 192
PLAIN_REFRESH = 48

#: An exploration step's tree costs at most this many one-token verifications (`probe_nodes`).
PROBE_COST = 1.5
#: ... and may always grow this many nodes.
PROBE_MIN_NODES = 8
#: ... and grows at least this many (when the proposal has them), whatever the latency model says:
#: a sample has to measure a tree. After a calibration beside a second CPU-heavy process, the
#: model priced C(2) at twice C(1) (c = 64: 186 against 89 ms; quiet, both cost about 33-39 ms),
#: so every tree stopped at its root. Samples of the draft arm then paid a drafter pass for one
#: token, the free proposals' steps were plain steps, and with no tree timed the profiler could
#: not see the wrong shape: four whole requests of the float32 matrix's busy run decoded plain
#: (docs/controller.md, "Empty free proposals go to the draft", "Samples that verify a tree").
PROBE_FLOOR_NODES = 4


class BudgetController:
    """Owns the latency model, the running step-time estimates, the gates and the surrogate checks
    (`surrogate` for full drafts, `surrogate_cheap` for the drafter's free proposals).

    model: calibrated LatencyModel. settings: PolicySettings (min/max nodes, bucket, top_k).
    calibration_points: [(s, c, seconds)] reused by online refits. registry: prometheus
    registry (default controller.metrics.REGISTRY). surrogate_correction: apply the per-depth
    scale to proposals in `correct`, both checks (off by default here; the served controller
    turns it on, bastion/factory.py). max_depth: drafter depth (block size - 1).
    t_draft_init / t_other_init: seconds assumed before the first drafted step is measured.
    refit_threshold / refit_window: drift MAPE (fraction) over that many steps that triggers a
    background refit. gate: the SpeculationGate of single-sequence steps (default one; batch-size
    classes get gates with its settings). table_every: steps between updates
    of the latency-table and online-error gauges (single and batched steps counted apart; the
    calibrated table is published at construction, at context 0). seq_overhead: calibrated seconds a batched
    forward costs per sequence beyond the first (CalibrationResult.seq_overhead), refined online
    by batched steps.
    Batched steps (docs/method.md, section 9) get a global policy from `batch_policy`, are
    judged by one gate per batch-size class (1, 2, 3-4, 5-8, ...: whether drafting pays
    depends on how loaded the forward is) and are recorded by `observe_batch`.
    plain_history: recent plain steps kept per batch size for the measured baseline.
    size_caps: cap each tree at the size of best measured throughput (`sizes`,
    controller/sizing.py). Off by default: once the few-row forwards were fixed
    (docs/engine.md), the caps ratcheted the draft arm down to 3-4 nodes on the avx512_bf16 EPYC,
    where fixed 8-node trees paid 1.6x on math. Sizes above a binding cap are seen only by probes
    of the best arm, so a drafter sampled as a loser never showed what larger trees commit
    (docs/controller.md, "Size caps off"). The tables are kept either way (`snapshot`).
    """

    def __init__(self, model: LatencyModel, settings: PolicySettings | None = None, *,
                 calibration_points: Sequence[tuple[int, int, float]] = (), registry: CollectorRegistry | None = None,
                 surrogate_correction: bool = False, max_depth: int = 15, t_draft_init: float = 0.0,
                 t_other_init: float = 0.0, refit_threshold: float = 0.15, refit_window: int = 64,
                 history: int = 512, gate: SpeculationGate | None = None, table_every: int = 16,
                 heldout_mape: float | None = None, seq_overhead: float = 0.0, plain_history: int = 16,
                 size_caps: bool = False):
        self.settings = settings or default_settings("cpu")
        self.metrics = controller_metrics(registry)
        self.profiler = OnlineProfiler(model, calibration_points, history=history, window=refit_window,
                                       threshold=refit_threshold, on_refit=self._on_refit,
                                       on_rescale=self._on_rescale)
        self.profiler.t_draft.value = t_draft_init
        self.profiler.t_other.value = t_other_init
        self.gate = gate or SpeculationGate()
        self._gate_proto = (self.gate.alpha, self.gate.explore_every, self.gate.arms)
        self._batch_gates: dict[int, SpeculationGate] = {}
        self.seq_overhead = RunningMean(0.1, max(float(seq_overhead), 0.0))
        self.seq_overhead.count = 1  # the calibrated value is the first sample: online ones refine it
        self._batch_draft: dict[int, RunningMean] = {}
        self._batch_other: dict[int, RunningMean] = {}
        # Recent plain steps per batch size: (cached tokens in all, measured seconds of the step,
        # the controller's step count then).
        self._plain: dict[int, collections.deque] = {}
        self._plain_history = plain_history
        self._plain_ratio: dict[int, tuple] = {}  # cached (model, seq_overhead, median ratio); dropped on a new plain step
        self.batch_steps = 0
        self._last: tuple[str, int] = ("plain", -1)  # the last single-sequence step: kind, context after it
        self._steady_draft = RunningMean(0.3)  # draft seconds of drafted steps that follow drafted steps
        self.surrogate = SurrogateCalibrator(max_depth=max_depth, enabled=surrogate_correction)
        # The drafter's free proposals (a suffix index) are calibrated apart: their scores miss
        # in their own way, and pooled with the full drafter's they skewed both (docs/controller.md).
        self.surrogate_cheap = SurrogateCalibrator(max_depth=max_depth, enabled=surrogate_correction)
        # Measured tokens per tree size, for the trees of full drafts and of free proposals apart.
        self.sizes = {"draft": RealisedSizes(), "cheap": RealisedSizes()}
        self.size_caps = size_caps
        self._step_cap = self.settings.max_nodes  # the node cap the last single-sequence step was given
        self._free_cap = 0  # the node cap of the free proposal tried first (`free_first`)
        self._free_step = False  # this single-sequence step runs the free tree in the draft arm's place
        self._last_free = False  # the last recorded step was such a step (for traces)
        self.table_every = table_every
        self.steps = 0
        self.step_kinds = {"draft": 0, "cheap": 0, "plain": 0}
        self.calibration: CalibrationResult | None = None
        self._costs: list[float] = []
        self._costs_key: tuple[int, LatencyModel] | None = None
        self.metrics.set_params(model.params)
        if heldout_mape is not None:
            self.metrics.fit_error.labels(kind="calibration_heldout").set(heldout_mape)
        self.metrics.drafting.set(1)
        # The calibrated table is known before any step: publish it (at an empty context) now.
        self.update_table(0)

    # ---- construction -----------------------------------------------------------------

    @classmethod
    def from_calibration(cls, result: CalibrationResult, settings: PolicySettings | None = None,
                         device: torch.device | str = "cpu", **kwargs) -> "BudgetController":
        """Controller from a CalibrationResult; settings default to the device's (CPU_SETTINGS / GPU_SETTINGS)."""
        kwargs.setdefault("seq_overhead", result.seq_overhead)
        return cls(result.model(), settings or default_settings(device), calibration_points=result.points,
                   heldout_mape=result.heldout_mape, **kwargs)

    @classmethod
    def from_target(cls, config, dtype: torch.dtype, measure_fn: MeasureFn, *, device: torch.device | str = "cpu",
                    model_name: str | None = None, attn_backend: str | None = None,
                    cache_dir: Path | str | None = None, grid: CalibrationGrid | None = None,
                    max_context: int | None = None, progress: bool = True, settings: PolicySettings | None = None,
                    measure_batch_fn: BatchMeasureFn | None = None, **kwargs) -> "BudgetController":
        """Calibrate (or load the matching cache) for a loaded target, then build the controller.

        config: target.model.config; dtype: target.dtype; measure_fn(s, c) -> seconds of one
        target forward (for example engine.timing.verify_timer); measure_batch_fn(b, n, c) ->
        seconds of one batched forward (engine.timing.batch_verify_timer; None: no batched points,
        the per-sequence overhead starts at 0 and is learnt online). Other keywords go to
        `calibrate` (model_name, attn_backend, cache_dir, grid, max_context, progress) or to
        the constructor (kwargs). Raises ValueError for an unsupported config or a failed fit.
        """
        result = calibrate(measure_fn, config, dtype, grid, model_name=model_name, device=device,
                           attn_backend=attn_backend, cache_dir=cache_dir, max_context=max_context, progress=progress,
                           measure_batch_fn=measure_batch_fn)
        controller = cls.from_calibration(result, settings, device, **kwargs)
        controller.calibration = result
        return controller

    # ---- per-step API -----------------------------------------------------------------

    @property
    def model(self) -> LatencyModel:
        """The current latency model (replaced by the profiler's inline refits and rescales)."""
        return self.profiler.model

    @property
    def t_draft(self) -> float:
        """Running estimate of the drafter's pass, seconds."""
        return self.profiler.t_draft.value

    @property
    def t_other(self) -> float:
        """Running estimate of a speculative step's overhead beyond draft and verify, seconds."""
        return self.profiler.t_other.value

    def verify_costs(self, context_len: int) -> list[float]:
        """[max_nodes + 1] C(n) seconds at context_len rounded down to a multiple of
        COST_CONTEXT_STEP, cached until that or the model changes."""
        model = self.profiler.model
        c = context_len - context_len % COST_CONTEXT_STEP
        if self._costs_key is None or self._costs_key[0] != c or self._costs_key[1] is not model:
            self._costs = model.verify_costs(self.settings.max_nodes, c)
            self._costs_key = (c, model)
        return self._costs

    def policy_for_step(self, context_len: int, state: RequestGates | None = None) -> AdaptivePolicy:
        """The stopping policy for a step whose target cache holds context_len tokens. Its fixed
        time is T_draft + T_other when the gate's choice is the full draft, T_other alone when it
        is the drafter's free proposal (which costs no drafter pass). state: the request's
        `sequence_state` (its own gate decides; None: the shared gate). A step that samples an
        arm which is not the gate's best (exploration) grows at most `probe_nodes` nodes, and no
        more than that arm's size of best measured throughput once one is known, and at least
        PROBE_FLOOR_NODES (a sample measures a tree, whatever the model prices); a step of its
        best arm at most that size (`sizes`, controller/sizing.py). When the choice is plain
        decoding the policy allows one node (nothing is drafted) and no cost table is computed."""
        st = self.settings
        self._free_step = False
        gate = self.solo_gate(state)
        self.refresh_plain(gate, 1)
        choice = gate.choice()
        if choice == "plain":
            return _PLAIN_POLICY
        draft_s = self.t_draft if choice == "draft" else 0.0
        costs = self.verify_costs(context_len)
        floor = st.min_nodes
        if self._probing(gate):
            # A sample judges the arm where it runs best: at its measured best size once known.
            best = self.sizes[choice].best(costs, draft_s + self.t_other, st.max_nodes) if self.size_caps else None
            max_nodes = self.probe_nodes(costs) if best is None else min(best, self.probe_nodes(costs))
            floor = max(floor, PROBE_FLOOR_NODES)
        elif self.size_caps:
            max_nodes = self.sizes[choice].cap(costs, draft_s + self.t_other, st.max_nodes)
        else:
            max_nodes = st.max_nodes
        self._step_cap = max_nodes
        return AdaptivePolicy(costs, draft_s + self.t_other, min(floor, max_nodes), max_nodes, st.bucket, st.top_k)

    def free_first(self, context_len: int, state: RequestGates | None = None) -> AdaptivePolicy | None:
        """On a single sequence's step whose gate's best arm is the full draft (not a sample of
        it): the stopping policy for the drafter's free proposal (`Drafter.propose_cheap`), tried
        before the drafter runs; None on any other step. Capped at the free proposals' size of best
        measured throughput (`sizes`), or `probe_nodes` before one is known. The engine builds the
        free tree and asks `free_suffices` whether the drafter's pass can be skipped
        (docs/method.md, section 8, "Free proposals first")."""
        self._free_step = False
        gate = self.solo_gate(state)
        if "cheap" not in gate.arms or gate.choice() != "draft" or self._probing(gate):
            return None
        st = self.settings
        costs = self.verify_costs(context_len)
        best = self.sizes["cheap"].best(costs, self.t_other, st.max_nodes) if self.size_caps else None
        self._free_cap = cap = self.probe_nodes(costs) if best is None else best
        return AdaptivePolicy(costs, self.t_other, min(st.min_nodes, cap), cap, st.bucket, st.top_k)

    def free_suffices(self, tree, context_len: int, state: RequestGates | None = None) -> bool:
        """Is the free proposal's tree (built with `free_first`'s policy from the corrected free
        proposal) expected to do at least as well as the full draft does on average? Its expected
        gain A_hat x C(1) / C(n) (n tree tokens: a plain step's time scaled by the model's cost
        ratio, no drafter pass) against the gate's average gain of the draft arm. When True the
        step verifies the free tree and is credited to the draft arm: the arm is the policy "the
        free tree when it suffices, else the full draft" (docs/method.md, section 8).
        tree: engine.tree.Tree (its `size` and `a_hat`, tokens expected with the bonus)."""
        g_draft = self.solo_gate(state).gain.get("draft")
        if g_draft is None or tree.size <= 1:
            return False
        costs = self.verify_costs(context_len)
        n = min(tree.size, len(costs) - 1)
        if tree.a_hat * costs[1] / max(costs[n], 1e-12) < g_draft:
            return False
        self._free_step = True
        self._step_cap = self._free_cap
        return True

    def free_empty(self, state: RequestGates | None = None) -> bool:
        """A single sequence's step whose choice was the drafter's free proposal, which came back
        empty: that arm's sample is known without running it (a plain step: gain 1, length 1), so
        it is recorded now, on the request's gate and the shared gate as `record_step` would.
        The step then takes the better of the full draft and plain decoding by the gate's values
        (plain decoding counted with its margin, as when the gate picks): True when that is the
        full draft (the engine runs the drafter and asks `policy_for_step` again; the gate's next
        choice is the draft), False for a plain step (docs/method.md, section 8, "Empty free
        proposals")."""
        gate = self.solo_gate(state)
        if gate.forced is not None or gate.choice() != "cheap":  # a forced arm runs as forced (`prime_gate`)
            return False
        self._record_arm(gate, False, False, 1.0, 1.0, also=self.gate)  # the cheap arm's sample
        arm = gate.best(without="cheap")
        gate.sample(arm)
        return arm == "draft"

    @staticmethod
    def _probing(gate: SpeculationGate) -> bool:
        """Is the gate's next step a sample of an arm that is not its best (or never tried)?"""
        choice = gate.choice()
        return choice != "plain" and (gate.gain[choice] is None or choice != gate.best())

    def probe_nodes(self, costs: Sequence[float], roots: int = 1) -> int:
        """The most nodes an exploration step may verify: the largest n with C(n) <= PROBE_COST x
        C(roots) (costs: `verify_costs`, or `batch_costs` for a batch of `roots` sequences), at
        least roots + PROBE_MIN_NODES - 1, at most settings.max_nodes. An arm that is not the
        best is sampled to learn whether it pays, which a small tree shows as well (a drafter
        that pays has its best nodes first), at a bounded price: unbounded, one sample built
        from over-confident scores verified 61 nodes for 2 tokens, five plain steps' time on the
        CPU (docs/controller.md, "Robust choices"). The floor keeps a probe able to show a gain
        where even C(2) costs 1.5 C(1) (the AMX CPU of docs/controller.md, where 8- and 16-node
        trees ran 1.5-1.6x faster than plain decoding)."""
        limit = PROBE_COST * costs[roots]
        n = roots
        while n + 1 < len(costs) and costs[n + 1] <= limit:
            n += 1
        return min(max(roots + PROBE_MIN_NODES - 1, n), self.settings.max_nodes)

    def should_draft(self, batch_size: int = 1, state: RequestGates | None = None) -> bool:
        """False when the full drafter is not this step's choice at this batch size (the gate's best
        arm, or the arm it explores). A single sequence's step asks its own gate (state: its
        `sequence_state`; None: the shared gate); a batched step the batch-size class's."""
        return self._deciding_gate(batch_size, state).should_draft()

    def allow_cheap(self, batch_size: int = 1, state: RequestGates | None = None) -> bool:
        """On a step that does not draft: True when the drafter's free proposals are the choice
        (their trees still cost verification, so they are judged like drafts)."""
        return self._deciding_gate(batch_size, state).choice() == "cheap"

    def _deciding_gate(self, batch_size: int, state: RequestGates | None) -> SpeculationGate:
        return self.solo_gate(state) if batch_size <= 1 else self.gate_for(batch_size)

    def solo_gate(self, state: RequestGates | None = None) -> SpeculationGate:
        """The gate that decides a single sequence's step: the request's own (created from the
        shared gate at its first such step, see RequestGates), or the shared gate without a state."""
        if state is None:
            return self.gate
        if state.solo is None:
            alpha, every, arms = self._gate_proto
            state.solo = SpeculationGate(alpha, every, arms)
            state.solo.inherit(self.gate)
        return state.solo

    def gate_for(self, batch_size: int) -> SpeculationGate:
        """The gate of a batch-size class: `gate` for 1, else one per power-of-two ceiling of
        batch_size. A new class starts from the averages of the largest smaller class that exists."""
        if batch_size <= 1:
            return self.gate
        key = self.size_class(batch_size)
        gate = self._batch_gates.get(key)
        if gate is None:
            gate = self._batch_gates[key] = self._batch_gate(self._gate_proto[2], self.batch_bar(key))
            smaller = [k for k in self._batch_gates if k < key]
            gate.inherit(self._batch_gates[max(smaller)] if smaller else self.gate)
        return gate

    def _record_arm(self, gate: SpeculationGate, drafted: bool, cheap: bool, tokens: float,
                    length: float | None, also: SpeculationGate | None = None, free_step: bool = False) -> None:
        """Credit a finished step to the arm it used, at gain = tokens / length: tokens committed
        per sequence, length the step's seconds over a plain step's (what the gate also scales
        exploration by). A plain step on which the free proposal was the choice (but found
        nothing) is the cheap arm's, at a plain step's gain and length. gate: the gate that
        decided the step; also: a second gate credited with the same arm at weight SHARED_ALPHA
        (the shared gate, when a request's own gate decided); free_step: a free tree run in the
        draft arm's place (`free_suffices`), credited to the draft arm."""
        if drafted or cheap:
            arm = "draft" if drafted or free_step else "cheap"
        else:
            arm = "cheap" if gate.choice() == "cheap" else "plain"
            tokens, length = 1.0, 1.0
        for g in (gate, also) if also is not None and also is not gate else (gate,):
            if arm in g.gain and length is not None and 0 < length < float("inf") and 0 <= tokens < float("inf"):
                g.record(arm, tokens / length, length, alpha=SHARED_ALPHA if g is also else None)
            else:  # a gate restricted to fewer arms (bastion calibrate drafts every step), or a bad timing
                g.tick()

    def predicted_plain_seconds(self, context_len: int, batch_size: int = 1, model: LatencyModel | None = None) -> float:
        """The latency model's seconds of a plain step's forward: C(1, c), or C_b(b) plus the
        per-sequence overhead for a batch caching context_len tokens in all. model: default the current one."""
        model = model or self.model
        if batch_size <= 1:
            return float(model.predict(1, context_len))
        return model.predict_batch(batch_size, batch_size, context_len) + self.seq_overhead.value * (batch_size - 1)

    def plain_step_seconds(self, context_len: int, batch_size: int = 1) -> float:
        """Seconds of a plain step of batch_size sequences caching context_len tokens in all:
        the model's forward at this context times the median ratio of recent measured plain
        steps (verify and other time) to the model's forward at theirs; without any at this
        batch size, the single-sequence ratio; without any at all, the model alone.

        Recent: of the last PLAIN_MAX_AGE steps (single and batched counted together). Older
        plain steps tell what the machine was doing then, and while drafting looks best few
        new ones replace them: plain steps timed during a busy start-up kept the baseline at
        about twice the quiet machine's for whole requests, every speculative step looked
        1.6-1.9 times better than plain decoding, and bastion ran at 0.82x AR (docs/controller.md,
        "A stale plain baseline, the batched bar, and refits that stall"). Fresh ones come at
        least every PLAIN_REFRESH steps (`refresh_plain`)."""
        model = self.profiler.model  # once: a background refit may swap it meanwhile
        ratio = self._measured_ratio(batch_size, model)
        if ratio is None and batch_size > 1:
            ratio = self._measured_ratio(1, model)
        return self.predicted_plain_seconds(context_len, batch_size, model) * (1.0 if ratio is None else ratio)

    @property
    def _step_count(self) -> int:
        """Steps recorded so far, single and batched: the clock plain steps' ages are kept in."""
        return self.steps + self.batch_steps

    def refresh_plain(self, gate: SpeculationGate, b: int) -> None:
        """Before a step of b sequences decided by `gate`: when b's newest measured plain step is
        PLAIN_REFRESH steps old or more (or there is none after PLAIN_REFRESH steps), make this
        step plain (`SpeculationGate.sample`), so the baseline drafting is judged against stays
        measured (`plain_step_seconds`)."""
        if gate.forced is not None or "plain" not in gate.arms:
            return
        hist = self._plain.get(b)
        if self._step_count - (hist[-1][2] if hist else 0) >= PLAIN_REFRESH:
            gate.sample("plain")

    def _fresh_plain(self, b: int) -> bool:
        """Drop plain steps older than PLAIN_MAX_AGE from b's history; True when any remain."""
        hist = self._plain.get(b)
        oldest = self._step_count - PLAIN_MAX_AGE
        while hist and hist[0][2] < oldest:
            hist.popleft()
            self._plain_ratio.pop(b, None)
        return bool(hist)

    def _measured_ratio(self, b: int, model: LatencyModel) -> float | None:
        """Median of b's fresh plain steps' measured seconds over the model's prediction at theirs;
        None without any."""
        if not self._fresh_plain(b):
            return None
        hist = self._plain[b]
        overhead = self.seq_overhead.value if b > 1 else 0.0
        cached = self._plain_ratio.get(b)
        if cached is None or cached[0] is not model or cached[1] != overhead:
            cs = np.array([c for c, _, _ in hist])
            ts = np.array([t for _, t, _ in hist])
            if b == 1:
                pred = model.predict(np.ones(len(cs)), cs)
            else:
                pred = np.array([self.predicted_plain_seconds(int(c), b, model) for c in cs])
            self._plain_ratio[b] = cached = (model, overhead, float(np.median(ts / pred)))
        return cached[2]

    def _add_plain(self, b: int, context_total: int, seconds: float) -> None:
        self._plain.setdefault(b, collections.deque(maxlen=self._plain_history)).append(
            (int(context_total), float(seconds), self._step_count))
        self._plain_ratio.pop(b, None)

    # ---- batched steps ----------------------------------------------------------------

    def _batch_mean(self, table: dict[int, RunningMean], b: int, fallback: float) -> float:
        m = table.get(b)
        return fallback if m is None or m.count == 0 else m.value

    def batch_fixed_seconds(self, b: int) -> float:
        """T_draft(b) + T_other(b), seconds: measured at this batch size, else the single-sequence
        values; T_other(b) alone when the batch-size class's gate chooses the free proposal."""
        draft_s = self._batch_mean(self._batch_draft, b, self.t_draft) if self.gate_for(b).choice() == "draft" else 0.0
        return draft_s + self._batch_mean(self._batch_other, b, self.t_other)

    def batch_costs(self, b: int, context_total: int) -> list[float]:
        """[max_nodes + 1] C_b(N) seconds for a batch of b sequences caching context_total tokens in all."""
        return self.model.batch_costs(self.settings.max_nodes, b, context_total, self.seq_overhead.value)

    def batch_policy(self, contexts: Sequence[int]) -> BatchAdaptivePolicy:
        """The global stopping policy of a batched step over sequences caching `contexts` tokens
        (docs/method.md, section 9): at most settings.max_nodes nodes in all, and per tree; at most
        `probe_nodes` in all when the batch-size class's gate samples an arm that is not its best."""
        b = len(contexts)
        st = self.settings
        if b > st.max_nodes:
            raise ValueError(f"a batch of {b} sequences exceeds the node cap of {st.max_nodes}")
        self.refresh_plain(self.gate_for(b), b)
        costs = self.batch_costs(b, int(sum(contexts)))
        # A sample of an arm that is not the class's best verifies a small batch (`probe_nodes`).
        max_nodes = self.probe_nodes(costs, roots=b) if self._probing(self.gate_for(b)) else st.max_nodes
        return BatchAdaptivePolicy(costs, self.batch_fixed_seconds(b), max_nodes, st.max_nodes, st.top_k)

    def sequence_state(self) -> RequestGates:
        """A request's own gates (RequestGates): for batched steps (arms draft and plain;
        docs/method.md, section 9), whether drafting pays for this request, judged by its
        marginal gain (`observe_batch`); for its single-sequence steps, all three arms, started
        from the shared gate (`solo_gate`). Its batch gate keeps only the arms the controller's
        gate has (a gate of the draft arm alone drafts every sequence of every step)."""
        arms = tuple(a for a in ("draft", "plain") if a in self._gate_proto[2]) or ("plain",)
        # its bar is set per step from the step's batch size (`sequence_drafts`)
        return RequestGates(self._batch_gate(arms, BATCH_SPECULATION_BAR))

    def _batch_gate(self, arms: tuple[str, ...], bar: float) -> SpeculationGate:
        """A gate of batched steps (a batch-size class's, a request's inside batches): one average,
        and plain decoding counts as `bar` (`batch_bar`), not below 1 as in the single-stream
        gate's near-tie rule. In batched steps drafting's gains sit near 1 for long stretches; with
        the single-stream margin these gates kept drafting at 4 and 8 clients, at 0.88-0.90 of
        batched AR, and at a bar of 1 the free proposals ran at 0.92 of batched AR at 8 clients
        while their steps' gains read 1.00-1.29 (docs/controller.md, "A stale plain baseline, the
        batched bar, and refits that stall")."""
        alpha, every, _ = self._gate_proto
        return SpeculationGate(alpha, every, arms, slow_alpha=alpha, plain_margin=1.0 - bar)

    @staticmethod
    def size_class(batch_size: int) -> int:
        """The batch-size class of a step of batch_size (>= 2) sequences: the power of two at or above it."""
        return 1 << (int(batch_size) - 1).bit_length()

    @staticmethod
    def batch_bar(batch_size: int) -> float:
        """The factor by which drafting must beat a plain batched step of batch_size sequences
        (>= 2): PAIR_SPECULATION_BAR for two, BATCH_SPECULATION_BAR for three or four,
        WIDE_SPECULATION_BAR for more (docs/method.md, section 9)."""
        if batch_size <= 2:
            return PAIR_SPECULATION_BAR
        return BATCH_SPECULATION_BAR if batch_size <= 4 else WIDE_SPECULATION_BAR

    def sequence_drafts(self, state: RequestGates | None, batch_size: int) -> bool:
        """In a batched step of batch_size sequences whose class gate drafts: True when this
        request's own gate drafts (its best arm, or the one it explores), judged at the bar of
        this batch size (`batch_bar`); True for a request without one."""
        if state is None:
            return True
        state.batch.plain_margin = 1.0 - self.batch_bar(batch_size)
        return state.batch.should_draft()

    @staticmethod
    def marginal_gains(stats: Sequence, plain_s: float) -> list[tuple[float, float] | None]:
        """Per sequence of a drafted batched step: (gain, length) of its own drafting, or None for a
        sequence that did not draft (docs/method.md, section 9, "Per-sequence gates").

        The step's time beyond a plain batched step (plain_s seconds, b tokens) is split among
        the drafting sequences: the drafter pass equally, the rest of the excess by speculative
        nodes (tree size - 1). Sequence r's marginal seconds m_r buy accepted_r - 1 extra tokens,
        so, as if it alone had drafted, length_r = 1 + m_r / plain_s and
        gain_r = (1 + (accepted_r - 1) / b) / length_r: above 1 exactly when its extra tokens per
        second beat the plain batch's b / plain_s.
        """
        b = len(stats)
        first = stats[0]
        drafting = [st for st in stats if st.drafted]
        if not drafting or plain_s <= 0:
            return [None] * b
        step_s = first.draft_s + first.verify_s + first.other_s
        verify_extra = max(step_s - plain_s - first.draft_s, 0.0)
        nodes = sum(st.tree_size - 1 for st in drafting)
        out: list[tuple[float, float] | None] = []
        for st in stats:
            if not st.drafted:
                out.append(None)
                continue
            m = first.draft_s / len(drafting) + (verify_extra * (st.tree_size - 1) / nodes if nodes else 0.0)
            length = 1.0 + m / plain_s
            out.append(((1.0 + (st.accepted - 1) / b) / length, length))
        return out

    def observe_batch(self, stats: Sequence, trees: Sequence, states: Sequence | None = None) -> None:
        """Record a finished batched step (b >= 2 sequences in one forward).

        stats: each sequence's engine.accounting.StepStats (phase times are the batch's, shared);
        trees: their verified Trees; states: their `sequence_state`s (None: none). A
        roots-only step refines the per-sequence overhead of the batched cost (measured verify
        time minus the roofline's C_b, per extra sequence) and the measured plain step time at
        this batch size; a drafted one T_draft(b) and T_other(b), feeds the batch-size class's
        gate with its realised gain over a plain batched step (`plain_step_seconds`) and each
        sequence's own gate with its marginal gain (`marginal_gains`; plain for a sequence its
        gate kept out). Drafted and cheap trees go each to their own surrogate check (`surrogate_for`).
        """
        b = len(stats)
        if b < 2:
            raise ValueError("observe_batch records steps of two sequences or more; use observe")
        first = stats[0]
        n = sum(st.tree_size for st in stats)
        c_total = sum(st.context_len for st in stats)
        model = self.model
        base = model.predict_batch(n, b, c_total)
        if n == b:  # roots only: what the roofline misses is the per-sequence work, not tree size
            self.seq_overhead.add(max((first.verify_s - base) / (b - 1), 0.0))
            self._add_plain(b, c_total, first.verify_s + first.other_s)
        predicted = base + self.seq_overhead.value * (b - 1)
        drafted = any(st.drafted for st in stats)
        cheap = not drafted and any(st.cheap for st in stats)
        gate = self.gate_for(b)
        if drafted:
            self._batch_draft.setdefault(b, RunningMean(0.3)).add(first.draft_s)
            self._batch_other.setdefault(b, RunningMean(0.3)).add(first.other_s)
        length = None
        if drafted or cheap:
            # Realised tokens/s over a plain batched step's (b tokens per plain step).
            plain_s = self.plain_step_seconds(c_total, b)
            length = max(first.draft_s + first.verify_s + first.other_s, 1e-12) / plain_s
        self._record_arm(gate, drafted, cheap, sum(st.accepted for st in stats) / b, length)
        if drafted and states is not None:
            for state, marginal in zip(states, self.marginal_gains(stats, plain_s)):
                if state is None:
                    continue
                arm = "plain" if marginal is None else "draft"
                if arm in state.batch.arms:
                    state.batch.record(arm, *(marginal or ()))
                else:  # a gate without that arm (`sequence_state`): time passes
                    state.batch.tick()
        for st, tree in zip(stats, trees):
            if st.drafted or st.cheap:
                sur = self.surrogate_for(st.cheap)
                sur.record(st.a_hat, st.accepted, depth_mass(tree.depths, tree.log_scores, sur.max_depth))
            kind = "draft" if st.drafted else "cheap" if st.cheap else "plain"
            self.step_kinds[kind] += 1
        self.batch_steps += 1
        self.metrics.observe_step(first.verify_s, predicted, self.t_draft, self.t_other, gate.best() == "draft")
        if self.batch_steps % self.table_every == 0:
            self.update_table(c_total // b)  # at the batch's mean context

    def correct(self, proposal: Proposal, cheap: bool = False) -> Proposal:
        """Surrogate correction of the drafter's proposal, Marginals or CandidateTree (identity
        unless enabled); cheap: the proposal is the drafter's free part (`Drafter.propose_cheap`),
        corrected by its own calibrator (`surrogate_for`)."""
        return self.surrogate_for(cheap).correct(proposal)

    def surrogate_for(self, cheap: bool) -> SurrogateCalibrator:
        """The surrogate calibrator of full drafts (`surrogate`) or of free proposals (`surrogate_cheap`)."""
        return self.surrogate_cheap if cheap else self.surrogate

    def record_step(self, s: int, c: int, verify_s: float, draft_s: float, other_s: float, a_hat: float,
                    accepted: int, *, drafted: bool = True, depth_mass: np.ndarray | None = None,
                    cheap: bool = False, state: RequestGates | None = None, path: Sequence[int] | None = None
                    ) -> None:
        """Feed one finished step to the profiler, the gate and the surrogate check, then
        export the controller's gauges (latency predicted vs measured, T_draft, T_other, gate).

        s: tokens verified (tree size, root included; 1 for a plain step); c: cached tokens
        before the step; verify_s / draft_s / other_s: seconds; a_hat: the tree's surrogate;
        accepted: tokens committed, bonus included; drafted: False for a plain step;
        cheap: a step (drafted False) that verified the drafter's free proposal
        (`Drafter.propose_cheap`): the gate credits it to its cheap arm, the free proposals' own
        surrogate check (`surrogate_cheap`) records it;
        depth_mass: `controller.surrogate.depth_mass` of the tree as built (after the matching
        check's correction), for per-depth reliability;
        state: the request's `sequence_state` (its own gate and the shared gate are both credited);
        path: the accepted non-root node indices of a drafted or cheap step's tree, for the
        measured tokens per tree size (`sizes`; None: not recorded there).
        A refit, when due, runs inline (controller/profiler.py: about 15 ms, every few hundred steps at most).
        """
        costs = self.verify_costs(c)
        predicted = costs[s] if s < len(costs) else self.model.predict(s, c)
        self.profiler.record(s, c, verify_s, predicted, draft_s, other_s, drafted)
        step_s = max(draft_s + verify_s + other_s, 1e-12)
        length = None
        if drafted:
            # A drafted step that does not directly follow a drafted step of the same sequence
            # also absorbs the context since (the prompt, or plain steps) into the drafter: a
            # one-off cost of switching to it, not its price per step, so the gate judges it by
            # the steady draft time once one is known. Same sequence: the context grew by what
            # the previous step accepted.
            steady = self._last == ("draft", c)
            if steady:
                self._steady_draft.add(draft_s)
            judged = draft_s if steady or not self._steady_draft.count else min(draft_s, self._steady_draft.value)
            length = max(judged + verify_s + other_s, 1e-12) / self.plain_step_seconds(c)
        elif cheap:
            length = step_s / self.plain_step_seconds(c)
        elif s == 1:
            self._add_plain(1, c, verify_s + other_s)
        if drafted or cheap:
            self.surrogate_for(cheap).record(a_hat, accepted, depth_mass)
            if path is not None:
                self.sizes["draft" if drafted else "cheap"].record(s, self._step_cap, path, accepted)
        free_step, self._free_step = self._free_step and cheap, False
        self._last_free = free_step
        self._record_arm(self.solo_gate(state), drafted, cheap, accepted, length, also=self.gate,
                         free_step=free_step)
        self.steps += 1
        kind = "draft" if drafted else "cheap" if cheap else "plain"
        self._last = (kind, c + int(accepted))
        self.step_kinds[kind] += 1
        self.metrics.observe_step(verify_s, predicted, self.t_draft, self.t_other, self.gate.best() == "draft")
        if self.steps % self.table_every == 0:
            self.update_table(c)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %s n=%d c=%d A_hat=%.3f accepted=%d verify predicted=%.3f ms measured=%.3f ms "
                      "draft=%.3f ms other=%.3f ms", self.steps, kind, s, c, a_hat,
                      accepted, predicted * 1e3, verify_s * 1e3, draft_s * 1e3, other_s * 1e3)

    def observe(self, stats, tree, state: RequestGates | None = None) -> None:
        """The engine's per-step hook: `record_step` from a finished step.

        stats: the step's engine.accounting.StepStats; tree: the verified engine.tree.Tree
        (its depths and log_scores give the depth mass the surrogate check needs); state: the
        request's `sequence_state`.
        """
        proposed = stats.drafted or stats.cheap
        mass = depth_mass(tree.depths, tree.log_scores, self.surrogate.max_depth) if proposed else None
        path = None
        if proposed:
            parents, path, i = tree.parents.tolist(), [], stats.accepted_node
            while i > 0:
                path.append(i)
                i = parents[i]
        self.record_step(stats.tree_size, stats.context_len, stats.verify_s, stats.draft_s, stats.other_s,
                         stats.a_hat, stats.accepted, drafted=stats.drafted, depth_mass=mass, cheap=stats.cheap,
                         state=state, path=path)

    def snapshot(self) -> dict:
        """JSON-ready state for reports: steps by kind, the gates (SpeculationGate.snapshot), running T_draft / T_other
        (seconds), the latency model (parameters, residual, recent online MAPE) and the
        surrogate checks (mean A_hat vs realised accepted length, per-depth reliability): `surrogate`
        for full drafts, `surrogate_cheap` for free proposals."""
        model = self.model

        def num(x: float) -> float | None:  # JSON has no NaN
            return None if x != x else float(x)
        sur, sur_cheap = self.surrogate.snapshot(), self.surrogate_cheap.snapshot()
        for x in (sur, sur_cheap):
            x.update(mean_predicted=num(x["mean_predicted"]), mean_realised=num(x["mean_realised"]))
        return {
            "steps": dict(self.step_kinds), "gate": self.gate.snapshot(),
            "t_draft_s": self.t_draft, "t_other_s": self.t_other,
            "latency_params": model.params.to_dict(), "residual": [list(r) for r in model.residual],
            "online_mape": num(self.profiler.recent_mape()), "refits": self.profiler.refits,
            "rescales": self.profiler.rescales,
            "surrogate": sur, "surrogate_cheap": sur_cheap, "batch_steps": self.batch_steps, "seq_overhead_s": self.seq_overhead.value,
            "batch_gates": {str(k): g.snapshot() for k, g in sorted(self._batch_gates.items())},
            "sizes": {k: v.snapshot() for k, v in self.sizes.items()},
        }

    def update_table(self, context_len: int) -> None:
        """Refresh the latency-table gauge at context_len and the online error gauge."""
        m = self.metrics
        m.context.set(context_len)
        m.set_table(TABLE_S, self.model.predict(np.asarray(TABLE_S), np.full(len(TABLE_S), context_len)))
        err = self.profiler.recent_mape()
        if err == err:  # not nan
            m.fit_error.labels(kind="online").set(err)

    def _on_rescale(self, model: LatencyModel, factor: float) -> None:
        self.metrics.set_params(model.params)
        self.metrics.rescales.inc()

    def _on_refit(self, model: LatencyModel, err_before: float, err_after: float) -> None:
        self.metrics.set_params(model.params)
        self.metrics.refits.inc()
        self.metrics.fit_error.labels(kind="online").set(err_after)
