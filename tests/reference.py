"""Host reference implementations the tests compare the engine against (never used by the engine).

ancestor_matrix / tree_attention_mask: the tree mask built with numpy on the host.
accept_greedy: greedy acceptance as a Python walk over the tree (engine/greedy_device.py must agree).
reference_tree_attention: float64 attention with a dense mask and repeated KV heads.
gather_features: drafter features taken from all of a forward's hidden states (the engine
keeps only the layers it needs, engine.forward).
hf_forward: a transformers forward of the target over a DynamicCache (the engine runs its own).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from engine.attention import TreeAttention
from engine.tree import Tree


def ancestor_matrix(parents: torch.Tensor) -> np.ndarray:
    """[n, n] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    par = parents.tolist()
    n = len(par)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(par):
        if p >= 0:
            anc[i, : i] = anc[p, : i]
        anc[i, i] = True
    return anc


def tree_attention_mask(tree: Tree, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, n, prefix_len + n] for verifying `tree` over a cached prefix.

    Row i sees the whole prefix, node i itself and its ancestors (docs/method.md, section 5);
    0 where visible, the dtype's most negative value elsewhere.
    """
    n = tree.size
    visible = np.ones((n, prefix_len + n), dtype=bool)
    visible[:, prefix_len:] = ancestor_matrix(tree.parents)
    mask = torch.zeros((1, 1, n, prefix_len + n), dtype=dtype, device=device)
    mask.masked_fill_(~torch.from_numpy(visible).to(device)[None, None], torch.finfo(dtype).min)
    return mask


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance (docs/method.md, section 6): follow the target's argmax down the tree.

    logits: [n, V]. Returns (accepted node indices starting with the root 0, bonus token).
    """
    targ = torch.argmax(logits, dim=-1).tolist()
    kids = tree.children()
    path = [0]
    while True:
        t = targ[path[-1]]
        nxt = kids[path[-1]].get(t)
        if nxt is None:
            return path, t
        path.append(nxt)


def reference_tree_attention(q, k, v, tree: TreeAttention, scale: float) -> torch.Tensor:
    """Float64 reference (dense mask, repeated KV heads): [b, hq, n, d] in q's dtype (for tests)."""
    g = q.shape[1] // k.shape[1]
    kr = k.double().repeat_interleave(g, dim=1)
    vr = v.double().repeat_interleave(g, dim=1)
    scores = torch.matmul(q.double(), kr.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~tree.visible(), -math.inf)
    return torch.matmul(torch.softmax(scores, dim=-1), vr).to(q.dtype)


def gather_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor | None:
    """Concatenate hidden_states[l][0] for l in layers -> [n, len(layers) * H] (None if no layers)."""
    if not layers:
        return None
    return torch.cat([hidden_states[l][0] for l in layers], dim=-1)


def hf_forward(model, input_ids: torch.Tensor, cache=None, **kwargs):
    """transformers' own forward of `model` on [1, s] ids over `cache` (a DynamicCache, updated
    in place; None: no cache). kwargs go to the model call."""
    import inspect

    if cache is not None:
        key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        kwargs[key] = cache
    return model(input_ids=input_ids, use_cache=cache is not None, **kwargs)
