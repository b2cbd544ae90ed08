"""Tree verification: one target forward over the tree, and lossless sampling acceptance."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward import Segment, TargetForward
from engine.kv_cache import KVPool
from engine.sampling import SamplingParams, processed_probs
from engine.tree import Tree
from engine.tree_buffers import DeviceTree


@dataclass
class VerifyOutput:
    """Target outputs for every tree node.

    logits: [n, V]; features: [n, len(feature_layers) * H] target hidden states at the
    drafter's feature layers (None when no drafter needs them).
    """

    logits: torch.Tensor
    features: torch.Tensor | None


@torch.inference_mode()
def verify(forward: TargetForward, pool: KVPool, slot: int, device_tree: DeviceTree,
           feature_layers: tuple[int, ...], backend: str = "sdpa") -> VerifyOutput:
    """Run the target once over all tree nodes on top of the slot's cached prefix.

    The slot holds exactly device_tree.prefix_len committed tokens; the call writes the n
    nodes' keys and values behind them (keep the accepted ones with `KVPool.compact`).
    Positions are prefix_len + depth; node i sees the prefix, itself and its ancestors
    (docs/method.md, section 5). A single node is a plain causal step without a mask.
    device_tree: the tree loaded on the model's device (engine.tree_buffers).
    Raises CacheCapacityError (engine.kv_cache) when the tree does not fit the slot.
    """
    n = device_tree.size
    segment = Segment(slot, device_tree.prefix_len, n, device_tree.attention() if n > 1 else None)
    logits, feats = forward(pool, device_tree.tokens, device_tree.position_ids[0], [segment], feature_layers,
                            backend=backend)
    return VerifyOutput(logits=logits, features=feats)


@torch.inference_mode()
def verify_batch(forward: TargetForward, pool: KVPool, slots: list[int], device_trees: list[DeviceTree],
                 feature_layers: tuple[int, ...], backend: str = "sdpa") -> list[VerifyOutput]:
    """`verify` for several sequences in one forward: tree r over slot slots[r].

    Every tree attends to its own slot's prefix and its own ancestors only. Returns one
    VerifyOutput per tree (logits [n_r, V], features [n_r, F] or None), views of the batch's.
    """
    segments = [Segment(slot, dt.prefix_len, dt.size, dt.attention() if dt.size > 1 else None)
                for slot, dt in zip(slots, device_trees)]
    tokens = torch.cat([dt.tokens for dt in device_trees])
    positions = torch.cat([dt.position_ids[0] for dt in device_trees])
    logits, feats = forward(pool, tokens, positions, segments, feature_layers, backend=backend)
    outs, row = [], 0
    for dt in device_trees:
        end = row + dt.size
        outs.append(VerifyOutput(logits=logits[row:end], features=None if feats is None else feats[row:end]))
        row = end
    return outs


def accept_sample(
    tree: Tree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless sampling acceptance (docs/method.md, section 6): at each node draw x from the target's
    processed distribution; descend if a child carries x, else x is the bonus token.

    Every committed token is an exact sample of the target given its prefix, whatever
    the tree. logits: [n, V]. Returns (accepted node indices from the root, bonus token).
    """
    kids = tree.children()
    path = [0]
    while True:
        probs = processed_probs(logits[path[-1]], params)
        x = int(torch.multinomial(probs, 1, generator=generator))
        nxt = kids[path[-1]].get(x)
        if nxt is None:
            return path, x
        path.append(nxt)
