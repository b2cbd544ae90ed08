"""Acceptance of every tree of a step with one host read (docs/method.md, section 6).

A batched step verifies b trees in one forward; deciding what each sequence accepts needs the
target's choice at the tree's nodes on the host. Per sequence that would be one device-to-host
read each (on a GPU, one synchronisation each). Here the device work of every sequence is done
first, their results are concatenated, and one read brings all of them back:

- greedy sequences: `engine.greedy_device.greedy_packed` (accepted path, its length and the
  bonus token, computed on the device);
- sampling sequences with `draw_all`: one exact sample of the target's processed distribution at
  every node, drawn at once (`draw_nodes`); the host then walks the tree: from the root, descend to
  the child carrying the node's sample, else that sample is the bonus token. A node at depth d
  samples with the uniform of the output position it would fill (`engine.sampling.UniformStream`),
  by inverse CDF. The walk visits one node per depth, so the draws it uses are independent, and
  the committed tokens have exactly the distribution of the lazy walk
  (`engine.verifier.accept_sample`), which draws at each visited node in turn. Since a position's
  uniform does not depend on the tree, a seeded request's output does not depend on the trees the
  global budget gave it (which depend on what else runs).
- sampling sequences without `draw_all` walk lazily after the read (on a CPU a read costs nothing,
  while processing every node's distribution costs a top-p sort per node).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import verifier
from engine.greedy_device import greedy_from_host, greedy_packed
from engine.sampling import SamplingParams, UniformStream, processed_probs, sample_with_uniforms
from engine.tree import Tree
from engine.tree_buffers import DeviceTree


@dataclass
class Acceptance:
    """One tree's outcome. path: accepted node indices from the root (path[0] = 0); bonus: the
    token after the last accepted node; index: path as [len(path)] int64 on the device (greedy
    only; None otherwise)."""

    path: list[int]
    bonus: int
    index: torch.Tensor | None = None


def draw_nodes(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    """One exact sample per node: [n] int64 on the logits' device, row i drawn from the processed
    target distribution (temperature, top-k, top-p) of logits[i] with uniform uniforms[i].
    logits: [n, V]; uniforms: [n] in [0, 1) (by output position, `UniformStream`)."""
    return sample_with_uniforms(processed_probs(logits, params), uniforms)


def walk_drawn(tree: Tree, draws: list[int]) -> tuple[list[int], int]:
    """Host walk over per-node samples `draws` [n]: (accepted node indices from the root, bonus)."""
    kids = tree.children()
    path = [0]
    while True:
        x = draws[path[-1]]
        nxt = kids[path[-1]].get(x)
        if nxt is None:
            return path, x
        path.append(nxt)


def accept_batch(trees: list[Tree], device_trees: list[DeviceTree], logits: list[torch.Tensor],
                 params: list[SamplingParams], generators: list[torch.Generator | None],
                 streams: list[tuple[UniformStream, int] | None]) -> list[Acceptance | Exception]:
    """Acceptance of every tree of a step, in order, with one host read in all.

    trees / device_trees: the verified trees (host and device forms); logits: [n_r, V] per tree;
    params / generators: each sequence's sampling parameters and generator (None: the global
    one), for the lazy walk. streams: per sampling sequence, (its UniformStream, the output
    position its root's draw fills) to draw every node at once (`draw_nodes`), or None for the
    lazy walk (ignored for greedy sequences). A sequence whose own acceptance raises gets its
    exception in its place; the others are unaffected.
    """
    b = len(trees)
    out: list[Acceptance | Exception | None] = [None] * b
    parts, spans, tables = [], {}, {}
    row = 0
    for r in range(b):
        try:
            if params[r].greedy:
                packed, table = greedy_packed(device_trees[r], logits[r])
                tables[r] = table
            elif streams[r] is not None:
                stream, position = streams[r]
                dt = device_trees[r]
                u = stream.take(position, dt.max_depth + 1)[dt.depths]
                packed = draw_nodes(logits[r], params[r], u)
            else:
                continue
        except Exception as e:  # noqa: BLE001 - this sequence's failure, not the batch's
            out[r] = e
            continue
        parts.append(packed)
        spans[r] = (row, row + packed.numel())
        row += packed.numel()
    host = torch.cat(parts).tolist() if parts else []  # the step's one host read
    for r in range(b):
        if out[r] is not None:
            continue
        try:
            if r in spans:
                vals = host[spans[r][0]:spans[r][1]]
                if params[r].greedy:
                    g = greedy_from_host(vals, tables[r], device_trees[r].max_depth)
                    out[r] = Acceptance(g.path, g.bonus, g.index)
                else:
                    out[r] = Acceptance(*walk_drawn(trees[r], vals))
            else:
                out[r] = Acceptance(*verifier.accept_sample(trees[r], logits[r], params[r], generators[r]))
        except Exception as e:  # noqa: BLE001
            out[r] = e
    return out  # type: ignore[return-value]
