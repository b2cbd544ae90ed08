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


def accept_greedy_device(tree: DeviceTree, logits: torch.Tensor) -> GreedyAcceptance:
    """Follow the target's argmax down the tree, on the device; one host read.

    tree: the step's DeviceTree (n nodes); logits: [n, V] target logits on the same device
    (any float dtype). Node i is accepted when every node on its path from the root carries
    the argmax of its parent's logits and is the first child of that parent with that token
    (the host reference takes the first such child). The deepest accepted node ends the path.
    """
    n = tree.size
    targ = torch.argmax(logits, dim=-1)  # [n]; torch.argmax picks the first maximum, as the reference
    if n == 1:
        return GreedyAcceptance([0], int(targ[0]), tree.parents.new_zeros(1))
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
    packed = torch.cat([table[: D + 1], (dep[best] + 1)[None], targ[best][None]])
    host = packed.tolist()  # the step's one host read
    length, bonus = host[D + 1], host[D + 2]
    return GreedyAcceptance(host[:length], bonus, table[:length])
