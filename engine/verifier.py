"""Tree verification: one target forward with the tree mask, acceptance, and KV-cache compaction."""
from __future__ import annotations

import inspect
import threading
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


class FeatureTap:
    """Keeps the outputs of a few target layers during a forward, instead of all hidden states.

    layers: hidden-state indices in the Hugging Face convention (0 = the embedding output,
    l in 1..L-1 = decoder layer l's output, L = the final norm's output). Forward hooks on
    just those modules store a reference to their output (no copy) while `capture()` is
    active on this thread, so a prefill of n tokens holds len(layers) x [n, H] activations
    rather than (L + 1) x [n, H]. One tap per (model, layers), shared by every engine on it
    (`feature_tap`). Raises ValueError for an index outside 0..L.
    """

    def __init__(self, model, layers: tuple[int, ...]):
        self.layers = tuple(layers)
        self._local = threading.local()
        decoder = model.get_decoder()
        n = len(decoder.layers)
        for idx in sorted(set(self.layers)):
            if not 0 <= idx <= n:
                raise ValueError(f"feature layer {idx} is outside 0..{n} for this target")
            module = model.get_input_embeddings() if idx == 0 else decoder.norm if idx == n else decoder.layers[idx - 1]
            module.register_forward_hook(self._hook(idx))

    def _hook(self, idx: int):
        def store(module, args, output):
            found = getattr(self._local, "found", None)
            if found is not None:
                found[idx] = output[0] if isinstance(output, tuple) else output
        return store

    def capture(self) -> "FeatureTap":
        """Start keeping outputs on this thread (use as a context manager around one forward)."""
        self._local.found = {}
        return self

    def __enter__(self) -> "FeatureTap":
        return self

    def __exit__(self, *exc) -> None:
        self._local.done = self._local.found
        self._local.found = None

    def features(self) -> torch.Tensor:
        """[n, len(layers) * H]: the captured outputs of the last forward, concatenated in `layers` order."""
        done = self._local.done
        return torch.cat([done[idx][0] for idx in self.layers], dim=-1)


_TAPS: dict[tuple[int, tuple[int, ...]], tuple[object, FeatureTap]] = {}
_TAPS_LOCK = threading.Lock()


def feature_tap(model, layers: tuple[int, ...]) -> FeatureTap | None:
    """The FeatureTap of (model, layers), created on first use (None when no layer is needed)."""
    if not layers:
        return None
    key = (id(model), tuple(layers))
    with _TAPS_LOCK:
        entry = _TAPS.get(key)
        if entry is None or entry[0] is not model:  # the id may belong to a model that is gone
            entry = _TAPS[key] = (model, FeatureTap(model, tuple(layers)))
        return entry[1]


def target_forward(model, input_ids: torch.Tensor, cache, *, position_ids=None, attention_mask=None,
                   hidden: bool = False, logits_to_keep: int = 0, **extra):
    """One target forward on top of `cache` (updated in place); returns the transformers output.

    input_ids: [1, s]; position_ids: [1, s] or None (continue after the cache);
    attention_mask: [1, 1, s, c + s] additive or None (causal). Passes the cache under the
    keyword this transformers version expects ('cache', formerly 'past_key_values').
    hidden: also return every hidden state (prefer `forward_with_features`, which keeps
    only the layers a drafter reads).
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


def forward_with_features(model, input_ids: torch.Tensor, cache, feature_layers: tuple[int, ...], **kwargs):
    """`target_forward` plus the drafter's features: (output, [s, len(layers) * H] or None).

    The features come from forward hooks on just those layers (FeatureTap), so the model is
    never asked for all its hidden states.
    """
    tap = feature_tap(model, feature_layers)
    if tap is None:
        return target_forward(model, input_ids, cache, **kwargs), None
    with tap.capture():
        out = target_forward(model, input_ids, cache, **kwargs)
    return out, tap.features()


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
    out, feats = forward_with_features(model, dt.tokens[None], cache, feature_layers, position_ids=dt.position_ids,
                                       attention_mask=mask, **extra)
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
