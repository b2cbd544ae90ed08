"""Timing of target forwards through the engine's own verification path (for calibration)."""
from __future__ import annotations

import time
from typing import Callable

import torch

from engine.forward import Segment, target_forward_for
from engine.tree import Tree
from engine.tree_buffers import TreeBufferPool
from engine.verifier import verify_batch


class StepClock:
    """Timestamps of one decoding step's phases, true on any device.

    On a CPU a mark is the host clock. On CUDA, where kernels run after their launch, a mark is
    a CUDA event recorded on the current stream, and the intervals are read with `intervals()`
    after the step's one host read (the acceptance), which has waited for the work already:
    no extra synchronisation. Usage: start() at the step's beginning (it drops the marks of a
    step that failed before reading them), mark() at each phase boundary, then intervals().
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list = []

    def start(self) -> None:
        """Begin a step: forget earlier marks, then mark."""
        self._marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (len(marks) - 1 values); clears the marks."""
        marks, self._marks = self._marks, []
        if not self.cuda:
            return [b - a for a, b in zip(marks, marks[1:])]
        marks[-1].synchronize()  # the last mark follows the step's host read: already (nearly) done
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


def _chain_tree(s: int, vocab: int, gen: torch.Generator) -> Tree:
    toks = torch.randint(0, vocab, (s,), generator=gen)
    idx = torch.arange(s)
    return Tree(tokens=toks, parents=idx - 1, depths=idx, a_hat=float(s), log_scores=torch.zeros(s))


def verify_timer(model, feature_layers: tuple[int, ...] = (), backend: str = "sdpa",
                 capacity: int | None = None) -> Callable[[int, int], float]:
    """measure(s, c) -> seconds of one `verify` of an s-node tree over a cache of c tokens.

    Goes through the same code as decoding (engine.forward over a KV pool slot, the tree's
    attention when s > 1, the drafter's feature layers when it reads them). The slot is
    filled once per c by a real prefill of random tokens; the s verified rows are simply
    overwritten by the next call, so call the grid c-major. capacity: the pool's slot size
    (default: the target's whole position range). On CUDA the device is synchronised
    around the forward. Raises CacheCapacityError when c + s exceeds the capacity.
    """
    measure = batch_verify_timer(model, feature_layers, backend, capacity, max_batch=1)
    return lambda s, c: measure(1, s, c)


def batch_verify_timer(model, feature_layers: tuple[int, ...] = (), backend: str = "sdpa",
                       capacity: int | None = None, max_batch: int = 8) -> Callable[[int, int, int], float]:
    """measure(b, n, c) -> seconds of one `verify_batch` of b trees of n nodes each, every tree
    over its own slot of c cached tokens (the batched step's forward; see `verify_timer`).

    Slot 0 is filled once per c by a real prefill and copied to the others; max_batch: slots held. On CUDA the device
    is synchronised around the forward. Raises ValueError when b > max_batch,
    CacheCapacityError when c + n exceeds the capacity.
    """
    forward = target_forward_for(model)
    pool = forward.new_pool(max_batch, capacity or forward.max_positions)
    buffers = [TreeBufferPool(model.device) for _ in range(max_batch)]
    vocab = model.config.vocab_size
    dev = model.device
    gen = torch.Generator().manual_seed(0)
    state: dict = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def measure(b: int, n: int, c: int) -> float:
        if b > max_batch:
            raise ValueError(f"a batch of {b} exceeds the {max_batch} slots of this timer")
        if state.get("c") != c:
            if c > 0:
                ids = torch.randint(0, vocab, (c,), generator=gen).to(dev)
                forward(pool, ids, torch.arange(c, device=dev), [Segment(0, 0, c)], last_only=True, backend=backend)
                # The other slots get copies: a forward's cost does not depend on the cached values.
                for kv in (pool.keys, pool.values):
                    kv[:, 1:, :, :c] = kv[:, :1, :, :c]
            state["c"] = c
        trees = [buffers[r].load(_chain_tree(n, vocab, gen), c) for r in range(b)]
        sync()
        t0 = time.perf_counter()
        verify_batch(forward, pool, list(range(b)), trees, feature_layers, backend=backend)
        sync()
        return time.perf_counter() - t0

    return measure


def choose_dtype(model, candidates: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                 sizes: tuple[int, ...] = (1, 16), context: int = 256, repeats: int = 3, batch: int = 1
                 ) -> tuple[torch.dtype, dict[str, float]]:
    """The dtype whose verification is cheapest on this machine, by measurement.

    model: a loaded target. Each candidate other than the model's own dtype is timed on a
    converted copy, so the model's weights are never rounded by a trial (float32 -> bfloat16
    -> float32 would change them). The model is converted once, to the winner, if that is not
    its dtype already. The cost of a candidate is the sum over `sizes` of the median seconds of
    one s-node verification over `context` cached tokens, through the engine's forward, as the
    calibration times it; with `batch` > 1 (a server decoding that many sequences together) the
    median of one batched step of `batch` one-token rows, each over its own slot of `context`
    tokens, is added, since a CPU without bfloat16 matrix units can verify one sequence's tree
    faster in bfloat16 and still run the batched step slower (docs/engine.md). Returns
    (dtype, {dtype name: seconds}). On an AMX CPU or a GPU bfloat16 wins; on a CPU without
    bfloat16 matrix units float32 does for trees and batches.
    """
    import copy

    costs: dict[str, float] = {}
    workloads = [(1, s) for s in sizes] + ([(batch, 1)] if batch > 1 else [])
    for dtype in candidates:
        trial = model if dtype == model.dtype else copy.deepcopy(model).to(dtype)
        measure = batch_verify_timer(trial, capacity=context + max(sizes), max_batch=max(1, batch))
        total = 0.0
        for b, s in workloads:
            measure(b, s, context)  # warm-up
            times = sorted(measure(b, s, context) for _ in range(repeats))
            total += times[len(times) // 2]
        costs[str(dtype).removeprefix("torch.")] = total
        del trial, measure
    best = min(candidates, key=lambda d: costs[str(d).removeprefix("torch.")])
    if best != model.dtype:
        model.to(best)
    return best, costs
