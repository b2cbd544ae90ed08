"""Greedy acceptance on the device with one host read per step.

`engine.verifier.accept_greedy` walks the tree on the host: argmax of every row copied back,
then a Python loop over children. Here the same decision is made with a fixed number of
tensor ops on the device, and only the accepted path, its length and the bonus token come
back, in one read. The result is identical to `accept_greedy` (same argmax, same choice of
the first child when siblings share a token); tests/test_greedy_device.py checks this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.tree_buffers import DeviceTree


@dataclass
class GreedyAcceptance:
    """Outcome of one greedy acceptance.

    path: accepted node indices from the root (path[0] = 0), host ints; bonus: the target's
    token after the last accepted node; index: [len(path)] int64 on the device, the same
    indices (for KV compaction and feature gathering without a host-to-device copy).
    """

    path: list[int]
    bonus: int
    index: torch.Tensor


def greedy_packed(tree: DeviceTree, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half of greedy acceptance: (packed, table).

    packed: [D + 3] int64, the accepted node indices placed by depth (-1 past the path), the
    path's length and the bonus token (D = tree.max_depth); table: [D + 2] int64 whose first
    length entries are the path, for `greedy_from_host`. Node i is accepted when every node on
    its path from the root carries the argmax of its parent's logits and is the first child of
    that parent with that token (the host reference takes the first such child); the deepest
    accepted node ends the path. tree: the step's DeviceTree (n nodes); logits: [n, V] on the
    same device (any float dtype).
    """
    n = tree.size
    targ = torch.argmax(logits, dim=-1)  # [n]; torch.argmax picks the first maximum, as the reference
    if n == 1:
        table = tree.parents.new_zeros(1)
        return torch.cat([table, table + 1, targ[:1]]), table
    par, tok, dep = tree.parents, tree.tokens, tree.depths
    match = tok == targ[par.clamp(min=0)]
    # A later sibling with the same token is never reached by the reference walk.
    same = (par[:, None] == par[None, :]) & (tok[:, None] == tok[None, :])
    match &= ~same.tril(diagonal=-1).any(dim=1)
    match[0] = True
    anc = tree.ancestors
    ok = ~(anc & ~match[None, :]).any(dim=1)  # [n]: the whole path to node i matches
    # The accepted nodes form one chain (at most one matching child per node): the deepest ends it.
    best = torch.argmax(torch.where(ok, dep, -1))
    D = tree.max_depth
    # Ancestors of best, placed by depth; non-ancestors land in the spare column D + 1.
    cols = torch.where(anc[best], dep, D + 1)
    table = torch.full((D + 2,), -1, dtype=torch.long, device=tree.device)
    table.scatter_(0, cols, torch.arange(n, device=tree.device))
    return torch.cat([table[: D + 1], (dep[best] + 1)[None], targ[best][None]]), table


def greedy_from_host(host: list[int], table: torch.Tensor, max_depth: int) -> GreedyAcceptance:
    """The host half: `host` is the packed tensor of `greedy_packed` read back ([D + 3] ints;
    D = max_depth, 0 for a one-node tree)."""
    length, bonus = host[max_depth + 1], host[max_depth + 2]
    return GreedyAcceptance(host[:length], bonus, table[:length])


def accept_greedy_device(tree: DeviceTree, logits: torch.Tensor) -> GreedyAcceptance:
    """Follow the target's argmax down the tree, on the device; one host read (`greedy_packed`
    then `greedy_from_host`). tree: the step's DeviceTree (n nodes); logits: [n, V]."""
    packed, table = greedy_packed(tree, logits)
    return greedy_from_host(packed.tolist(), table, tree.max_depth)
