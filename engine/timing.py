"""Timing of target forwards through the engine's own verification path (for calibration)."""
from __future__ import annotations

import time
from typing import Callable

import torch

from engine.forward import Segment, target_forward_for
from engine.tree import Tree
from engine.tree_buffers import TreeBufferPool
from engine.verifier import verify


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
    forward = target_forward_for(model)
    pool = forward.new_pool(1, capacity or forward.max_positions)
    buffers = TreeBufferPool(model.device)
    vocab = model.config.vocab_size
    dev = model.device
    gen = torch.Generator().manual_seed(0)
    state: dict = {}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def measure(s: int, c: int) -> float:
        if state.get("c") != c:
            if c > 0:
                ids = torch.randint(0, vocab, (c,), generator=gen).to(dev)
                forward(pool, ids, torch.arange(c, device=dev), [Segment(0, 0, c)], last_only=True, backend=backend)
            state["c"] = c
        device_tree = buffers.load(_chain_tree(s, vocab, gen), c)
        sync()
        t0 = time.perf_counter()
        verify(forward, pool, 0, device_tree, feature_layers, backend=backend)
        sync()
        return time.perf_counter() - t0

    return measure
