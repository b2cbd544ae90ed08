"""The decoding loop: prefill, then per step draft -> build tree -> verify -> accept -> commit."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch

from drafting.base import Drafter
from drafting.proposal import Proposal
from engine.accounting import StepAccounting, StepStats, summarize
from engine.detokenizer import IncrementalDetokenizer
from engine.loader import Target
from engine.sampling import RequestError, SamplingParams, UniformStream, select_token
from engine.tree import (BatchStoppingPolicy, ChainPolicy, FixedBudgetPolicy, SingleNodePolicy, StoppingPolicy, Tree,
                         build_tree, build_trees)
from engine.forward import TREE_HEADROOM, target_forward_for
from engine.acceptance import Acceptance, accept_batch
from engine.timing import StepClock
from engine.tree_buffers import TreeBufferPool
from engine.verifier import PrefillChunk, VerifyOutput, verify_and_prefill

#: Modes whose controller is a fixed stopping policy (the adaptive one lives in controller/).
FIXED_MODES = ("ar", "chain", "tree")
#: Longest prompt piece one prefill forward takes (longer prompts run in chunks: bounded memory).
PREFILL_CHUNK = 2048


class ContextLengthError(RequestError):
    """Prompt + max_tokens exceed the target's context length (param: the prompt, or max_tokens
    when it alone leaves no room for any prompt)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message, param)


@dataclass
class GenerationEvent:
    """What one engine step yields to its caller (the scheduler or the CLI).

    token_ids: tokens committed in this event; text: the text delta that is now final
    (may be empty); finish_reason: None while running, else 'stop' | 'length' | 'cancelled';
    step: statistics of the verification step (None for the prefill event).
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    step: StepStats | None = None


@dataclass
class GenerationResult:
    """A whole generation (see `Engine.generate`). Times in seconds."""

    text: str
    token_ids: list[int]
    finish_reason: str
    steps: list[StepStats] = field(default_factory=list)
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length: committed tokens per verification step (bonus included)."""
        return summarize(self.steps).tau

    @property
    def mean_tree_size(self) -> float:
        """Mean nodes verified per step (root included)."""
        return summarize(self.steps).mean_tree_size


@dataclass
class Sequence:
    """All per-request state; nothing of it is shared between requests.

    slot: the sequence's slot in the engine's KV pool (prefix_len committed tokens; -1 once
    released); prefilled: prompt tokens in the slot so far (`Engine.prefill_step`); root: last
    committed token, not yet in the cache (-1 while prefilling); output_ids: committed output tokens.
    """

    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    detok: IncrementalDetokenizer
    drafter_state: object
    generator: torch.Generator | None
    eos: set[int]
    prefix_len: int = 0
    prefilled: int = 0
    root: int = -1
    output_ids: list[int] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    finish_reason: str | None = None
    pending: GenerationEvent | None = None
    control: object = None  # the controller's own state for this request (StepController.sequence_state)
    uniforms: UniformStream | None = None  # per-position uniforms when every tree node is drawn at once

    @property
    def n_out(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs of the loaded model, without the engine itself.

    name: the target's name; max_context: context length in tokens; dtype: compute dtype name.
    encode_chat(messages) -> prompt ids (chat template applied); encode_text(text) -> ids;
    check_length(prompt_len, max_tokens) raises RequestError / ContextLengthError for work
    that cannot fit.
    """

    name: str
    max_context: int
    dtype: str
    encode_chat: Callable[[list[dict]], list[int]]
    encode_text: Callable[[str], list[int]]
    check_length: Callable[[int, int], None]


class StepController(Protocol):
    """What the engine asks each step; the fixed modes and the adaptive controller implement it.

    Optional: `free_first(context_len, state) -> StoppingPolicy | None` and
    `free_suffices(tree, context_len, state) -> bool` let a controller have a single sequence's
    drafting step try the drafter's free proposal first and skip the drafter's pass when that
    tree suffices (controller.budget.BudgetController; `Engine._free_instead`);
    `free_empty(state) -> bool` lets it turn a single sequence's free-proposal step whose
    proposal came back empty into a full draft (`Engine._draft_instead`)."""

    def policy_for_step(self, context_len: int, state: object = None) -> StoppingPolicy:
        """Stopping policy for a step whose target cache holds context_len tokens (state: the
        sequence's `sequence_state` when it runs alone, else None)."""
        ...

    def should_draft(self, batch_size: int = 1, state: object = None) -> bool:
        """False: skip the full drafter this step (its free part, `Drafter.propose_cheap`, may still
        propose). batch_size: sequences in the step; state: the sequence's `sequence_state` when
        it runs alone (batch_size 1), else None."""
        ...

    def allow_cheap(self, batch_size: int = 1, state: object = None) -> bool:
        """On a step where `should_draft` is False: may the drafter's free part still propose?"""
        ...

    def batch_policy(self, contexts: list[int]) -> BatchStoppingPolicy | None:
        """One global stopping policy for a batched step over sequences caching `contexts` tokens
        (engine.tree.build_trees), or None: every sequence builds its tree with `policy_for_step`."""
        ...

    def correct(self, proposal: Proposal, cheap: bool = False) -> Proposal:
        """Optionally recalibrate the drafter's scores before the tree is built; cheap: the
        proposal is the drafter's free part (`Drafter.propose_cheap`)."""
        ...

    def observe(self, stats: StepStats, tree: Tree, state: object = None) -> None:
        """Record a finished step of one sequence (the online profiler's input); state: its
        `sequence_state`."""
        ...

    def sequence_state(self) -> object:
        """A new request's own controller state (kept in Sequence.control; None: none)."""
        ...

    def sequence_drafts(self, state: object, batch_size: int) -> bool:
        """In a batched step of batch_size sequences whose drafter runs (`should_draft`): does
        this sequence take part?"""
        ...

    def observe_batch(self, stats: list[StepStats], trees: list[Tree], states: list[object] | None = None) -> None:
        """Record a finished step of two sequences or more (phase times shared); states: each
        sequence's `sequence_state`, in the same order."""
        ...


@dataclass
class FixedController:
    """The same stopping policy every step, always drafting (modes ar, chain, tree)."""

    policy: StoppingPolicy

    def policy_for_step(self, context_len: int, state: object = None) -> StoppingPolicy:
        return self.policy

    def should_draft(self, batch_size: int = 1, state: object = None) -> bool:
        return True

    def allow_cheap(self, batch_size: int = 1, state: object = None) -> bool:
        return True

    def batch_policy(self, contexts: list[int]) -> None:
        return None  # a fixed mode gives every sequence its own tree of the same policy

    def correct(self, proposal: Proposal, cheap: bool = False) -> Proposal:
        return proposal

    def observe(self, stats: StepStats, tree: Tree, state: object = None) -> None:
        pass

    def sequence_state(self) -> None:
        return None

    def sequence_drafts(self, state: object, batch_size: int) -> bool:
        return True

    def observe_batch(self, stats: list[StepStats], trees: list[Tree], states: list[object] | None = None) -> None:
        pass


def make_controller(mode: str, budget: int = 32, block_size: int = 16) -> FixedController:
    """Controller for the fixed modes: 'ar' | 'chain' | 'tree' (best-first up to `budget` nodes).

    The adaptive 'bastion' mode takes its controller from controller/ instead.
    Raises ValueError for an unknown mode or a budget < 1.
    """
    if mode == "ar":
        return FixedController(SingleNodePolicy())
    if mode == "chain":
        return FixedController(ChainPolicy(max_nodes=block_size))
    if mode == "tree":
        if budget < 1:
            raise ValueError(f"tree budget must be >= 1, got {budget}")
        return FixedController(FixedBudgetPolicy(budget))
    raise ValueError(f"unknown fixed mode '{mode}' (choose from {', '.join(FIXED_MODES)})")


class Engine:
    """Tree speculative decoding over a loaded target: one sequence per step (`step`) or several
    verified in one forward (`step_batch`, their trees under one global budget when the controller
    gives one); prompts are prefilled whole (`start`) or in chunks (`begin` + `prefill_step`).

    target: the loaded Target. drafter: a Drafter or None (AR only).
    controller: a StepController (default: AR, one node per step).
    accounting: StepAccounting every step is recorded in (default: a fresh one).
    slots: sequences whose KV cache the pool holds at first (it grows when more run at once).
    backend: tree attention backend (engine.attention.BACKENDS).
    The target runs through engine.forward (its own forward over the preallocated KV pool);
    each slot holds the context length plus room for one tree (TREE_HEADROOM rows).
    """

    def __init__(self, target: Target, drafter: Drafter | None = None, controller: StepController | None = None,
                 accounting: StepAccounting | None = None, slots: int = 1, backend: str = "sdpa"):
        self.target = target
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.drafter = drafter
        self.controller = controller or make_controller("ar")
        self.eos_ids = target.eos_token_ids
        self.accounting = accounting if accounting is not None else StepAccounting()
        self.backend = backend
        self.forward = target_forward_for(self.model)
        self.pool = self.forward.new_pool(slots, min(self.max_context() + TREE_HEADROOM, self.forward.max_positions))
        # Tree index buffers, one per bucket size, reused by every step of every request.
        self.buffers = TreeBufferPool(self.model.device)
        self._batch_buffers = [self.buffers]  # one pool per position in a batched step
        self._clock = StepClock(self.model.device)
        # Sampling sequences draw every tree node at once where a host read costs a device
        # synchronisation; on a CPU the lazy walk processes fewer distributions (engine.acceptance).
        self.draw_all = self.model.device.type != "cpu"

    # ---- prompt handling -------------------------------------------------------------
    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Apply the target's chat template (generation prompt added) -> token ids.

        Thinking is disabled (Qwen3 templates read `enable_thinking`; others ignore it):
        the published Qwen3 DFlash drafters were trained without thinking traces.
        """
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True, enable_thinking=False)
        return list(out["input_ids"])

    def max_context(self) -> int:
        return self.target.max_context

    def info(self) -> ModelInfo:
        """The serving-facing description of this engine's model (see ModelInfo)."""
        return ModelInfo(name=self.target.name, max_context=self.max_context(),
                         dtype=str(self.model.dtype).removeprefix("torch."), encode_chat=self.chat_prompt_ids,
                         encode_text=lambda text: list(self.tokenizer(text)["input_ids"]),
                         check_length=self.check_length)

    def reserve_slots(self, slots: int) -> None:
        """Grow the KV pool to hold `slots` sequences now, so that no admission copies the pool
        later (a grow copies every held slot: about 0.4 GB per slot for the embedded default in
        float32; unused capacity costs address space only, see engine.kv_cache)."""
        if slots > self.pool.num_slots:
            self.pool.grow(slots)

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse work that cannot fit: raises ContextLengthError naming the numbers."""
        limit = self.max_context()
        if prompt_len == 0:
            raise RequestError("the prompt is empty", "messages")
        if prompt_len >= limit:
            raise ContextLengthError(f"the prompt ({prompt_len} tokens) leaves no room for a completion in the "
                                     f"context length of {limit} tokens")
        if max_tokens >= limit:
            raise ContextLengthError(f"max_tokens ({max_tokens}) leaves no room for the prompt in the context "
                                     f"length of {limit} tokens", "max_tokens")
        if prompt_len + max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                f"exceeds the context length of {limit} tokens"
            )

    # ---- the loop ----------------------------------------------------------------------
    def start(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate, prefill the prompt and pick the first token (the first root).

        Returns the request's Sequence; its `pending` event carries the first token.
        Raises RequestError (ContextLengthError included) before any work on bad input.
        """
        seq = self.begin(prompt_ids, params)
        while self.prefill_step(seq) is None:
            pass
        return seq

    def begin(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Validate and take a KV slot, without any forward: the prompt is then prefilled by
        `prefill_step` calls (a scheduler interleaves them with other sequences' steps).
        Raises RequestError (ContextLengthError included) on bad input, holding nothing.
        """
        params.validate()
        self.check_length(len(prompt_ids), params.max_tokens)
        gen = None
        if not params.greedy and params.seed is not None:
            # On the model's device: the sampling draws run there (a CPU generator cannot drive CUDA).
            gen = torch.Generator(device=self.model.device).manual_seed(int(params.seed))
        drafter = self.drafter
        if self.pool.free_slots == 0:
            self.pool.grow(2 * self.pool.num_slots)
        return Sequence(
            prompt_ids=list(prompt_ids),
            params=params,
            slot=self.pool.allocate(),
            detok=IncrementalDetokenizer(self.tokenizer, params.stop),
            drafter_state=drafter.new_state() if drafter is not None else None,
            generator=gen,
            eos=set() if params.ignore_eos else set(self.eos_ids),
            control=self.controller.sequence_state(),
        )

    def prefill_step(self, seq: Sequence, max_tokens: int = PREFILL_CHUNK) -> GenerationEvent | None:
        """Prefill the next `max_tokens` (at most) prompt tokens of a sequence from `begin`: their
        keys and values go into its slot and the drafter gets their features. After the last
        chunk the first token is picked and committed: returns that event (also `seq.pending`);
        None while prompt tokens remain. On an error the slot is released and the error raised.
        Raises ValueError when the sequence is released or already prefilled, or max_tokens < 1.
        (`step_mixed` runs such chunks inside a decoding step of other sequences.)
        """
        out = self._prefill_only([seq], [self._prefill_chunk(seq, max_tokens)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _prefill_chunk(self, seq: Sequence, max_tokens: int) -> PrefillChunk:
        """The next chunk of a prefilling sequence's prompt (at most max_tokens tokens). Raises
        ValueError when the sequence is released or already prefilled, or max_tokens < 1 (its
        slot kept); any other error releases the slot."""
        if seq.slot < 0 or seq.root >= 0:
            raise ValueError("prefill needs a sequence from begin() that is still prefilling")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        end = min(seq.prefilled + max_tokens, len(seq.prompt_ids))
        try:
            ids = torch.tensor(seq.prompt_ids[seq.prefilled:end], dtype=torch.long, device=self.model.device)
        except BaseException:
            self.release(seq)
            raise
        return PrefillChunk(seq.slot, seq.prefilled, ids)

    def _prefill_done(self, seq: Sequence, chunk: PrefillChunk, out: VerifyOutput) -> GenerationEvent | None:
        """After a chunk's forward: hand its features to the drafter; after the prompt's last
        chunk pick and commit the first token (the returned event, also `seq.pending`), else None.
        On an error the slot is released and the error raised."""
        end = chunk.start + len(chunk.tokens)
        try:
            with torch.inference_mode():
                if self.drafter is not None:
                    self.drafter.extend(seq.drafter_state, seq.prompt_ids[chunk.start:end], out.features)
                seq.prefilled = end
                if end < len(seq.prompt_ids):
                    return None
                seq.root = select_token(out.logits[0], seq.params, seq.generator)
            seq.prefix_len = len(seq.prompt_ids)
            committed, finish = self._commit(seq, [seq.root])
            seq.pending = GenerationEvent(committed, seq.detok.release(final=finish is not None), finish, None)
        except BaseException:
            self.release(seq)
            raise
        if finish is not None:
            self._finished(seq, committed)
        return seq.pending

    def release(self, seq: Sequence) -> None:
        """Give the sequence's KV slot back to the pool (idempotent). The engine does this itself
        when a sequence finishes; a caller that abandons a running sequence calls it."""
        if seq.slot >= 0:
            self.pool.release(seq.slot)
            seq.slot = -1

    def _finished(self, seq: Sequence, committed: list[int]) -> None:
        self.release(seq)
        if self.drafter is not None:
            self.drafter.finish(seq.drafter_state, committed)

    def step(self, seq: Sequence) -> GenerationEvent:
        """One decoding step: draft, build the tree, verify, accept, compact, commit.

        Returns the step's event (finish_reason set when the request ends).
        """
        out = self.step_batch([seq])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _plan_batch(self, seqs: list[Sequence], failed: dict[int, Exception]) -> dict[int, tuple[Tree, bool, bool]]:
        """Draft and build this step's trees: {r: (tree, drafted, cheap)} for the sequences that
        did not fail (a sequence's own error goes to failed[r]).

        One drafter pass over every sequence that drafts (`Drafter.propose_batch`; if it fails,
        each sequence is retried alone so the failure stays with its own). With two sequences or
        more and a controller that has a global policy, one best-first heap over all their
        candidates decides every tree's size (engine.tree.build_trees); otherwise, or when a
        proposal fails while the heap reads it, each sequence builds its own tree with
        `policy_for_step`.
        """
        drafter, controller = self.drafter, self.controller
        b = len(seqs)
        batch_policy = controller.batch_policy([s.prefix_len for s in seqs]) if b > 1 else None
        alone = seqs[0].control if b == 1 else None  # a sequence alone: its own gate decides
        policies = [None] * b if batch_policy is not None else \
            [controller.policy_for_step(s.prefix_len, alone) for s in seqs]
        depths = [0] * b
        for r, seq in enumerate(seqs):
            remaining = seq.params.max_tokens - seq.n_out
            cap = batch_policy.max_nodes_per_tree if batch_policy is not None else policies[r].max_nodes
            if drafter is not None and cap > 1 and remaining > 1:
                depths[r] = min(drafter.max_depth, remaining - 1)
        want = [r for r in range(b) if depths[r] > 0]
        drafted = bool(want) and controller.should_draft(b, alone)
        proposals: dict[int, Proposal | None] = {}
        trees: dict[int, Tree] = {}
        if drafted and b == 1:  # the free proposal first: when it suffices, the drafter's pass is skipped
            free = self._free_instead(seqs[0], depths[0], alone, failed)
            if free is not None or failed:
                drafted, want = False, []
                if free is not None:
                    proposals[0], trees[0] = free
        if drafted and b > 1:  # each sequence's own gate: does drafting pay for this request?
            want = [r for r in want if controller.sequence_drafts(seqs[r].control, b)]
            drafted = bool(want)
        if want and drafted:
            try:
                outs = drafter.propose_batch([seqs[r].drafter_state for r in want], [seqs[r].root for r in want],
                                             [depths[r] for r in want])
                for r, out in zip(want, outs):
                    if isinstance(out, Exception):
                        failed[r] = out
                    else:
                        proposals[r] = out
            except Exception:  # noqa: BLE001 - the shared pass failed: find the sequence at fault, each alone
                for r in want:
                    try:
                        proposals[r] = drafter.propose(seqs[r].drafter_state, seqs[r].root, depths[r])
                    except Exception as e:  # noqa: BLE001 - this sequence's failure, not the batch's
                        failed[r] = e
        elif want and controller.allow_cheap(b, alone):  # the full drafter does not pay now; its free part may
            for r in want:
                try:
                    proposals[r] = drafter.propose_cheap(seqs[r].drafter_state, seqs[r].root, depths[r])
                except Exception as e:  # noqa: BLE001
                    failed[r] = e
            if b == 1 and proposals.get(0) is None and not failed:
                drafted = self._draft_instead(seqs[0], depths[0], alone, policies, proposals, failed)
        live = [r for r in range(b) if r not in failed]
        for r in live:
            if proposals.get(r) is not None and r not in trees:  # a free tree run instead is corrected already
                try:
                    proposals[r] = controller.correct(proposals[r], cheap=not drafted)
                except Exception as e:  # noqa: BLE001
                    failed[r] = e
        live = [r for r in live if r not in failed]
        max_depths = {r: depths[r] if proposals.get(r) is not None else 0 for r in live}
        if batch_policy is not None:
            try:
                trees = dict(zip(live, build_trees([seqs[r].root for r in live], [proposals.get(r) for r in live],
                                                   batch_policy, [max_depths[r] for r in live])))
            except Exception:  # noqa: BLE001 - a proposal failed while read: build each tree alone to find it
                trees = {}
        for r in live:
            if r not in trees:
                try:
                    policy = policies[r] or controller.policy_for_step(seqs[r].prefix_len, alone)
                    trees[r] = build_tree(seqs[r].root, proposals.get(r), policy, max_depths[r])
                except Exception as e:  # noqa: BLE001 - this sequence's failure, not the batch's
                    failed[r] = e
        plans = {}
        for r, tree in trees.items():
            # A tree larger than the slot's room past the prefix (only a policy above TREE_HEADROOM
            # nodes can build one) is cut to its best prefix-closed part.
            tree = tree.head(self.pool.capacity - seqs[r].prefix_len)
            has = proposals.get(r) is not None
            plans[r] = (tree, drafted and r in proposals, has and not drafted)
        return plans

    def _draft_instead(self, seq: Sequence, depth: int, state: object, policies: list, proposals: dict,
                       failed: dict[int, Exception]) -> bool:
        """A single sequence's step whose free proposal came back empty: True when the controller
        turns it into a full draft instead (`free_empty`; controllers without it never do), with
        policies[0] and proposals[0] then set for that draft. The drafter's own error goes to
        failed[0] (False)."""
        controller = self.controller
        empty = getattr(controller, "free_empty", None)
        if empty is None or not empty(state):
            return False
        policies[0] = controller.policy_for_step(seq.prefix_len, state)  # may turn the step plain (a refresh)
        if not controller.should_draft(1, state):
            return False
        try:
            proposals[0] = self.drafter.propose(seq.drafter_state, seq.root, depth)
        except Exception as e:  # noqa: BLE001 - this sequence's failure
            failed[0] = e
            return False
        return True

    def _free_instead(self, seq: Sequence, depth: int, state: object, failed: dict[int, Exception]
                      ) -> tuple[Proposal, Tree] | None:
        """A single sequence's step that would draft: (the corrected free proposal, its tree) when
        the controller finds that tree enough (`free_first`, `free_suffices`; controllers without
        them always draft), else None. The proposal's own error goes to failed[0]."""
        controller = self.controller
        first = getattr(controller, "free_first", None)
        policy = first(seq.prefix_len, state) if first is not None and depth > 0 else None
        if policy is None:
            return None
        try:
            free = self.drafter.propose_cheap(seq.drafter_state, seq.root, depth)
            if free is None:
                return None
            free = controller.correct(free, cheap=True)
            tree = build_tree(seq.root, free, policy, depth)
            return (free, tree) if controller.free_suffices(tree, seq.prefix_len, state) else None
        except Exception as e:  # noqa: BLE001 - this sequence's failure
            failed[0] = e
            return None

    def step_batch(self, seqs: list[Sequence]) -> list[GenerationEvent | Exception]:
        """One decoding step for several running sequences: `step_mixed` without prompt chunks
        (see there for what is returned and raised)."""
        return self.step_mixed(seqs, ())[0]

    @torch.inference_mode()
    def step_mixed(self, seqs: list[Sequence], prefills: "list[tuple[Sequence, int]] | tuple[()]" = ()
                   ) -> tuple[list[GenerationEvent | Exception], list[GenerationEvent | None | Exception]]:
        """One decoding step for several running sequences, their trees verified in one forward.

        Each sequence drafts and builds its own tree; one target forward then carries every tree
        (each attends to its own KV slot and its own ancestors only, engine.forward.Segment);
        every tree's acceptance is decided with one host read for the whole batch
        (engine.acceptance); compaction, stops and max_tokens stay per sequence, each with its
        own sampling parameters and generator. Returns one event per sequence, in order, or the
        exception that sequence's own work raised (its drafter, tree or acceptance): that
        sequence is released and the others go on. An error of the shared forward is raised. Phase
        times in each StepStats are the batch's (shared); the controller observes steps only
        when one sequence ran, since its latency model prices one tree per forward.

        prefills: (sequence from `begin`, max tokens) pairs whose next prompt chunk rides in the
        same forward (`prefill_step`'s work, docs/engine.md "Prefill inside a step"): the step's
        running sequences then wait for no separate prefill forward. Returns (the running
        sequences' results as above; per prefill its first-token event once its prompt is done,
        None while prompt tokens remain, or the exception its own work raised, its slot then
        released). A step that carries prompt chunks is not shown to the controller: its time
        is not a tree's. An error of the shared step releases the chunks' sequences too.
        Raises ValueError when a sequence appears twice, a running one is still prefilling or has
        finished, or a prefill's sequence is not prefilling (nothing is run or held then).
        """
        pre = [s for s, _ in prefills]
        if len({id(s) for s in list(seqs) + pre}) != len(seqs) + len(pre) or \
                any(s.slot < 0 or s.root < 0 or s.finish_reason for s in seqs):
            raise ValueError("step_batch needs distinct running sequences (prefilled, not finished)")
        chunks = [self._prefill_chunk(s, n) for s, n in prefills]
        if not seqs:
            return [], self._prefill_only(pre, chunks)
        try:
            return self._step_mixed(seqs, pre, chunks)
        except BaseException:
            for s in pre:  # the shared step failed: no chunk's sequence is left half-prefilled
                self.release(s)
            raise

    def _step_mixed(self, seqs: list[Sequence], pre: list[Sequence], chunks: list[PrefillChunk]
                    ) -> tuple[list[GenerationEvent | Exception], list[GenerationEvent | None | Exception]]:
        drafter = self.drafter
        feature_layers = drafter.feature_layers if drafter is not None else ()
        clock = self._clock
        clock.start()
        failed: dict[int, Exception] = {}
        plans = self._plan_batch(seqs, failed)
        live = [r for r in range(len(seqs)) if r not in failed]
        clock.mark()
        while len(self._batch_buffers) < len(seqs):
            self._batch_buffers.append(TreeBufferPool(self.model.device))
        device_trees = {r: self._batch_buffers[i].load(plans[r][0], seqs[r].prefix_len) for i, r in enumerate(live)}
        clock.mark()
        verified = {}
        chunk_outs = []
        if live or chunks:
            outs, chunk_outs = verify_and_prefill(self.forward, self.pool, [seqs[r].slot for r in live],
                                                  [device_trees[r] for r in live], chunks, feature_layers,
                                                  backend=self.backend)
            verified = dict(zip(live, outs))
        clock.mark()
        accepted = accept_batch([plans[r][0] for r in live], [device_trees[r] for r in live],
                                [verified[r].logits for r in live], [seqs[r].params for r in live],
                                [seqs[r].generator for r in live], [self._uniforms(seqs[r]) for r in live])
        results = {}
        for r, acc in zip(live, accepted):
            seq, (tree, drafted, cheap), out = seqs[r], plans[r], verified[r]
            try:
                if isinstance(acc, Exception):
                    raise acc
                results[r] = self._commit_accepted(seq, tree, acc, out) + (tree, drafted, cheap)
            except Exception as e:  # noqa: BLE001 - this sequence's failure, not the batch's
                failed[r] = e
        # After acceptance: a completed prompt's first token is a host read of its own.
        prefilled = [self._prefill_guarded(s, c, o) for s, c, o in zip(pre, chunks, chunk_outs)]
        clock.mark()
        draft_s, load_s, verify_s, commit_s = clock.intervals()
        prompt_tokens = sum(len(c.tokens) for c in chunks)
        events: list[GenerationEvent | Exception] = []
        observed: list[tuple[StepStats, Tree, object]] = []
        for r, seq in enumerate(seqs):
            if r in failed:
                self.release(seq)
                events.append(failed[r])
                continue
            path, committed, finish, context_len, tree, drafted, cheap = results[r]
            stats = StepStats(tree_size=tree.size, accepted=len(committed), accepted_depth=len(path) - 1,
                              context_len=context_len, a_hat=tree.a_hat, drafted=drafted, draft_s=draft_s,
                              verify_s=verify_s, other_s=load_s + commit_s, cheap=cheap,
                              prompt_tokens=prompt_tokens, accepted_node=path[-1])
            seq.steps.append(stats)
            self.accounting.record(stats)
            if finish is not None:
                # The root was committed earlier but, like this step's tokens, never reached the drafter.
                self._finished(seq, [seq.root] + committed)
            events.append(GenerationEvent(committed, seq.detok.release(final=finish is not None), finish, stats))
            observed.append((stats, tree, seq.control))
        if live:
            self.accounting.record_forward([plans[r][0].size for r in live])
        if chunks:  # the step's time includes prompt tokens: not what the controller's model prices
            return events, prefilled
        if len(live) == 1 and observed:  # the request's own gate decided only if it ran alone
            self.controller.observe(*observed[0][:2], observed[0][2] if len(seqs) == 1 else None)
        elif len(observed) > 1:
            self.controller.observe_batch(*(list(col) for col in zip(*observed)))
        return events, prefilled

    def _prefill_guarded(self, seq: Sequence, chunk: PrefillChunk, out: VerifyOutput
                         ) -> GenerationEvent | None | Exception:
        try:
            return self._prefill_done(seq, chunk, out)
        except Exception as e:  # noqa: BLE001 - this sequence's failure (its slot is released)
            return e

    def _prefill_only(self, seqs: list[Sequence], chunks: list[PrefillChunk]) -> list[GenerationEvent | None | Exception]:
        """Several sequences' prompt chunks in one forward, no running sequence beside them: per
        chunk its `_prefill_done` result or the exception its own work raised (slot released).
        An error of the forward releases every one of them and is raised."""
        if not chunks:
            return []
        feature_layers = self.drafter.feature_layers if self.drafter is not None else ()
        try:
            with torch.inference_mode():
                _, outs = verify_and_prefill(self.forward, self.pool, [], [], chunks, feature_layers,
                                             backend=self.backend)
        except BaseException:
            for s in seqs:
                self.release(s)
            raise
        return [self._prefill_guarded(s, c, o) for s, c, o in zip(seqs, chunks, outs)]

    def _uniforms(self, seq: Sequence) -> tuple[UniformStream, int] | None:
        """(the sequence's UniformStream, its next output position) when its sampling draws every
        tree node at once (`draw_all`), else None (greedy, or the lazy walk)."""
        if not self.draw_all or seq.params.greedy:
            return None
        if seq.uniforms is None:
            seq.uniforms = UniformStream(seq.generator, self.model.device)
        return seq.uniforms, seq.n_out

    def _commit_accepted(self, seq: Sequence, tree: Tree, acc: Acceptance, out: VerifyOutput
                         ) -> tuple[list[int], list[int], str | None, int]:
        """Commit, compaction and the drafter's update for one accepted tree:
        (path, committed tokens, finish_reason, context length before the step)."""
        drafter = self.drafter
        path, bonus, index = acc.path, acc.bonus, acc.index
        committed, finish = self._commit(seq, tree.tokens[path[1:]].tolist() + [bonus])
        context_len = seq.prefix_len
        if finish is None:
            self.pool.compact(seq.slot, seq.prefix_len, path, index)
            if drafter is not None:
                feats = out.features
                feats = feats[index if index is not None else path] if feats is not None else None
                drafter.extend(seq.drafter_state, tree.tokens[path].tolist(), feats)
            seq.prefix_len += len(path)
            seq.root = bonus
        return path, committed, finish, context_len

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        should_cancel: Callable[[], bool] | None = None,
    ) -> Iterator[GenerationEvent]:
        """Generate for one request, yielding the prefill's event and then one per step.

        The last event has a finish_reason ('cancelled' when should_cancel() turned True
        between steps). Raises ValueError / ContextLengthError before any work on bad input.
        """
        seq = self.start(prompt_ids, params)
        try:
            ev = seq.pending
            yield ev
            while ev.finish_reason is None:
                if should_cancel is not None and should_cancel():
                    seq.finish_reason = "cancelled"
                    self.release(seq)
                    yield GenerationEvent([], seq.detok.release(final=True), "cancelled", None)
                    return
                ev = self.step(seq)
                yield ev
        finally:  # an abandoned generator or a failed step must not keep the slot
            self.release(seq)

    @staticmethod
    def _commit(seq: Sequence, tokens: list[int]) -> tuple[list[int], str | None]:
        """Cut a step's tokens at EOS, a stop string or max_tokens; return (kept, finish_reason).

        EOS itself is not returned or counted; the token completing a stop string is.
        Updates seq.output_ids, seq.n_out and seq.finish_reason.
        """
        finish = None
        keep = tokens
        for i, t in enumerate(tokens):
            if t in seq.eos:
                keep, finish = tokens[:i], "stop"
                break
        room = seq.params.max_tokens - seq.n_out
        if len(keep) > room:
            keep, finish = keep[:room], None
        n = seq.detok.add(keep)
        if seq.detok.stopped:
            keep, finish = keep[:n], "stop"
        elif finish is None and seq.n_out + len(keep) >= seq.params.max_tokens:
            finish = "length"
        seq.output_ids.extend(keep)
        seq.finish_reason = finish
        return keep, finish

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Run `stream` to the end and collect text, tokens, steps and timings."""
        t0 = time.perf_counter()
        ttft = None
        text, ids, steps, finish = [], [], [], "stop"
        for ev in self.stream(prompt_ids, params):
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(ev.text)
            ids.extend(ev.token_ids)
            if ev.step is not None:
                steps.append(ev.step)
            if ev.finish_reason:
                finish = ev.finish_reason
        total = time.perf_counter() - t0
        return GenerationResult(
            text="".join(text),
            token_ids=ids,
            finish_reason=finish,
            steps=steps,
            prompt_tokens=len(prompt_ids),
            ttft_s=ttft or 0.0,
            decode_s=total - (ttft or 0.0),
        )
