"""Tree verification: one target forward with the tree mask, acceptance, and KV-cache compaction."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from engine.attention import TREE_KWARG, installed_backend
from engine.sampling import SamplingParams, processed_probs
from engine.tree import Tree
from engine.tree_buffers import DeviceTree, TreeBufferPool


@dataclass
class VerifyOutput:
    """Target outputs for every tree node.

    logits: [n, V]; features: [n, len(feature_layers) * H] target hidden states at the
    drafter's feature layers (None when no drafter needs them).
    """

    logits: torch.Tensor
    features: torch.Tensor | None


_CACHE_KW: dict[type, str] = {}


def target_forward(model, input_ids: torch.Tensor, cache, *, position_ids=None, attention_mask=None,
                   hidden: bool = False, logits_to_keep: int = 0, **extra):
    """One target forward on top of `cache` (updated in place); returns the transformers output.

    input_ids: [1, s]; position_ids: [1, s] or None (continue after the cache);
    attention_mask: [1, 1, s, c + s] additive or None (causal). Passes the cache under the
    keyword this transformers version expects ('cache', formerly 'past_key_values').
    extra: further model keywords, forwarded to the attention function (the tree, see engine.attention).
    """
    cls = type(model)
    if cls not in _CACHE_KW:
        params = inspect.signature(cls.forward).parameters
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    kwargs = {_CACHE_KW[cls]: cache}
    return model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=hidden,
        logits_to_keep=logits_to_keep,
        **kwargs,
        **extra,
    )


def gather_features(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor | None:
    """Concatenate hidden_states[l][0] for l in layers -> [n, len(layers) * H] (None if no layers)."""
    if not layers:
        return None
    return torch.cat([hidden_states[l][0] for l in layers], dim=-1)


_POOLS: dict[torch.device, TreeBufferPool] = {}


def _fallback_pool(device: torch.device) -> TreeBufferPool:
    """Buffers for callers of `verify` without their own (calibration, scripts): one pool per device."""
    if device not in _POOLS:
        _POOLS[device] = TreeBufferPool(device)
    return _POOLS[device]


@torch.inference_mode()
def verify(model, cache, tree: Tree, prefix_len: int, feature_layers: tuple[int, ...],
           device_tree: DeviceTree | None = None) -> VerifyOutput:
    """Run the target once over all tree nodes on top of the cached prefix.

    cache: transformers Cache holding exactly `prefix_len` committed tokens; after the
    call it holds prefix_len + n entries (compact it with `compact_cache`).
    Positions are prefix_len + depth; the mask lets node i see the prefix, itself and
    its ancestors (docs/method.md, section 5). A single node needs no mask (plain causal step).
    device_tree: `tree` already loaded on the model's device (engine.tree_buffers); when None
    it is loaded into a per-device pool shared by such callers. The mask is built on the
    device from it, without a host sync.
    """
    dt = device_tree if device_tree is not None else _fallback_pool(model.device).load(tree, prefix_len)
    mask, extra = None, {}
    if dt.size > 1:
        if installed_backend(model) is not None:
            extra = {TREE_KWARG: dt.attention()}  # the backend builds its own mask on the device
        else:
            mask = dt.additive_mask(model.dtype)
    out = target_forward(model, dt.tokens[None], cache, position_ids=dt.position_ids,
                         attention_mask=mask, hidden=bool(feature_layers), **extra)
    feats = gather_features(out.hidden_states, feature_layers) if feature_layers else None
    return VerifyOutput(logits=out.logits[0], features=feats)


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


def compact_cache(cache, prefix_len: int, path: list[int], index: torch.Tensor | None = None) -> None:
    """Keep prefix + the accepted tree nodes in the target's KV cache, in path order.

    cache holds prefix_len + n entries after `verify`. When the path is the tree's
    first len(path) nodes (a chain, or AR) this is a crop; otherwise one gather per
    layer through a temporary (the source and destination ranges may overlap).
    index: optional [len(path)] int64, the same path on the cache's device (from
    engine.greedy_device); without it the path is copied to each device once.
    """
    keep = prefix_len + len(path)
    if path != list(range(len(path))):
        src = (torch.tensor(path, dtype=torch.long) if index is None else index) + prefix_len
        on_device: dict[torch.device, torch.Tensor] = {}
        for layer in cache.layers:
            dev = layer.keys.device
            if dev not in on_device:
                on_device[dev] = src.to(dev, non_blocking=True)
            idx_d = on_device[dev]
            layer.keys[:, :, prefix_len:keep] = layer.keys.index_select(2, idx_d)
            layer.values[:, :, prefix_len:keep] = layer.values.index_select(2, idx_d)
    for layer in cache.layers:
        # Views, no copy: the next step's concatenation allocates anyway.
        layer.keys = layer.keys[:, :, :keep]
        layer.values = layer.values[:, :, :keep]
