"""Timing of target forwards through the engine's own verification path (for calibration)."""
from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import DynamicCache

from engine.tree import Tree
from engine.verifier import compact_cache, target_forward, verify


def _chain_tree(s: int, vocab: int, gen: torch.Generator) -> Tree:
    toks = torch.randint(0, vocab, (s,), generator=gen)
    idx = torch.arange(s)
    return Tree(tokens=toks, parents=idx - 1, depths=idx, a_hat=float(s), log_scores=torch.zeros(s))


def verify_timer(model, feature_layers: tuple[int, ...] = ()) -> Callable[[int, int], float]:
    """measure(s, c) -> seconds of one `verify` of an s-node tree over a cache of c tokens.

    Goes through the same code as decoding (tree mask when s > 1, hidden-state outputs
    when a drafter reads them). The cache is built once per c by a real prefill of
    random tokens and trimmed back after each call; call the grid c-major.
    On CUDA the device is synchronised around the forward.
    """
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
            cache = DynamicCache(config=model.config)
            if c > 0:
                target_forward(model, torch.randint(0, vocab, (1, c), generator=gen).to(dev), cache, logits_to_keep=1)
            state.update(c=c, cache=cache)
        cache = state["cache"]
        tree = _chain_tree(s, vocab, gen)
        sync()
        t0 = time.perf_counter()
        verify(model, cache, tree, c, feature_layers)
        sync()
        dt = time.perf_counter() - t0
        compact_cache(cache, c, [])  # drop the s verified entries
        return dt

    return measure
