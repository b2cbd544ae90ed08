"""Tree verification: one target forward over the tree, and lossless sampling acceptance."""
from __future__ import annotations

import itertools
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


@dataclass
class PrefillChunk:
    """A piece of a prompt that rides along in a verification forward.

    slot: the sequence's KV slot; start: prompt tokens already in it (the chunk's keys go to
    [start, start + n)); tokens: [n] int64 on the model's device.
    """

    slot: int
    start: int
    tokens: torch.Tensor


@torch.inference_mode()
def verify_batch(forward: TargetForward, pool: KVPool, slots: list[int], device_trees: list[DeviceTree],
                 feature_layers: tuple[int, ...], backend: str = "sdpa") -> list[VerifyOutput]:
    """Run the target once over the nodes of every tree, tree r on top of slot slots[r].

    Each slot holds exactly device_trees[r].prefix_len committed tokens; the call writes the
    tree's nodes behind them (keep the accepted ones with `KVPool.compact`). Positions are
    prefix_len + depth; node i sees its own slot's prefix, itself and its ancestors
    (docs/method.md, section 5), nothing of another tree. A one-node tree is a plain causal
    step without a mask. device_trees: engine.tree_buffers, on the model's device.
    Returns one VerifyOutput per tree (logits [n_r, V], features [n_r, F] or None), views of
    the batch's. Raises CacheCapacityError (engine.kv_cache) when a tree does not fit its slot.
    """
    return verify_and_prefill(forward, pool, slots, device_trees, (), feature_layers, backend)[0]


@torch.inference_mode()
def verify_and_prefill(forward: TargetForward, pool: KVPool, slots: list[int], device_trees: list[DeviceTree],
                       prefills: "list[PrefillChunk] | tuple[()]", feature_layers: tuple[int, ...],
                       backend: str = "sdpa") -> tuple[list[VerifyOutput], list[VerifyOutput]]:
    """`verify_batch`, with prompt chunks of other sequences in the same forward (docs/engine.md,
    "Prefill inside a step"): the linears read the weights once for the trees' nodes and the
    chunks' tokens together; each chunk attends causally to its own slot.

    Returns (one VerifyOutput per tree, as verify_batch; one per chunk with the logits of its
    last token [1, V] and the features of all its tokens [n, F] or None).
    Raises CacheCapacityError (engine.kv_cache) when a tree or a chunk does not fit its slot,
    ValueError for an empty chunk.
    """
    if any(int(p.tokens.shape[0]) < 1 for p in prefills):
        raise ValueError("a prefill chunk needs at least one token")
    segments = [Segment(slot, dt.prefix_len, dt.size, dt.attention() if dt.size > 1 else None)
                for slot, dt in zip(slots, device_trees)]
    segments += [Segment(p.slot, p.start, int(p.tokens.shape[0])) for p in prefills]
    dev = forward.device
    token_parts = [dt.tokens for dt in device_trees] + [p.tokens for p in prefills]
    position_parts = [dt.position_ids[0] for dt in device_trees]
    position_parts += [torch.arange(p.start, p.start + int(p.tokens.shape[0]), device=dev) for p in prefills]
    if len(token_parts) == 1:
        tokens, positions = token_parts[0], position_parts[0]
    else:
        tokens, positions = torch.cat(token_parts), torch.cat(position_parts)
    n_tree = sum(dt.size for dt in device_trees)
    logit_rows = None
    if prefills:  # every tree node's logits, only each chunk's last token's
        lasts = list(itertools.accumulate(int(p.tokens.shape[0]) for p in prefills))
        logit_rows = torch.tensor(list(range(n_tree)) + [n_tree + e - 1 for e in lasts], device=dev)
    logits, feats = forward(pool, tokens, positions, segments, feature_layers, backend=backend,
                            logit_rows=logit_rows)
    outs, row = [], 0
    for dt in device_trees:
        end = row + dt.size
        outs.append(VerifyOutput(logits=logits[row:end], features=None if feats is None else feats[row:end]))
        row = end
    chunk_outs = []
    for j, p in enumerate(prefills):
        end = row + int(p.tokens.shape[0])
        chunk_outs.append(VerifyOutput(logits=logits[n_tree + j:n_tree + j + 1],
                                       features=None if feats is None else feats[row:end]))
        row = end
    return outs, chunk_outs


def verify(forward: TargetForward, pool: KVPool, slot: int, device_tree: DeviceTree,
           feature_layers: tuple[int, ...], backend: str = "sdpa") -> VerifyOutput:
    """`verify_batch` for one tree over `slot` (what the calibration times)."""
    return verify_batch(forward, pool, [slot], [device_tree], feature_layers, backend)[0]


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
