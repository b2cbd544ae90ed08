"""The target's forward, run by the engine itself over a preallocated KV pool.

transformers' eager forward costs two to three times the weights' memory traffic at the
sizes a decode or verification step has (docs/engine.md): a cache that concatenates,
a dense 4-D mask, per-op dispatch through many small modules, and MKL re-packing every
weight on every call. `TargetForward` runs the same computation from the same weights
(llama, qwen2, qwen3 and mistral decoders; the op order follows transformers', so float32
logits agree to rounding) with:

- q, k, v and gate, up fused into one linear each, prepacked once where that is measured
  faster (engine.linear);
- the rotary tables computed once for the whole capacity by the model's own rotary module;
- keys and values written in place into a `KVPool` slot, attention reading a view of the
  valid prefix only (engine.attention: no mask for one token, the tree's small mask or a
  backend's own tree kernel otherwise);
- the drafter's feature layers kept as the loop passes them, nothing else;
- several sequences ("segments") in one forward: the linears run over all their tokens at
  once, attention per segment over its own slot (what batched verification needs); the
  one-token segments of a batched plain step share one padded attention call per layer
  (engine.attention.DecodeBatch).
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import (DecodeBatch, TreeAttention, causal_attention, causal_mask, choose_gqa_packing,
                              packed_gqa_attention, tree_attention)
from engine.kv_cache import KVPool
from engine.linear import Linear, choose_packing, choose_row_padding


@dataclass
class Segment:
    """One sequence's share of a forward.

    slot: its KV pool slot; start: tokens already cached in the slot (the new tokens' keys
    go to [start, start + n)); n: new tokens (rows of the forward, in order); tree: the tree
    of a verification (its prefix_len must equal start), or None for causal tokens.
    """

    slot: int
    start: int
    n: int
    tree: TreeAttention | None = None


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear
    down: Linear


#: Positions beyond the context length the rotary tables cover: a verification tree's nodes
#: sit at prefix + depth, and the pool keeps this many rows past the context for a tree.
TREE_HEADROOM = 1024


class TargetForward:
    """A decoder-only target's forward over a KVPool (one per model: see `target_forward_for`).

    model: the loaded transformers model (its weights are read, never changed). packed:
    prepack the linears (None: measure, see engine.linear.choose_packing). row_padding:
    {M: M'} few-row products run as M' zero-padded rows (None: measure on a CPU with packed
    linears, see engine.linear.choose_row_padding; {}: never). gqa_packing: the query row
    counts whose attention runs as engine.attention.packed_gqa_attention (None: measure, see
    engine.attention.choose_gqa_packing; an empty set: never). max_positions:
    positions the rotary tables cover (default: the model's context length + TREE_HEADROOM).
    batch_decode: run the attention of a forward's one-token causal segments as one call per
    layer (engine.attention.DecodeBatch) when there are two or more; False: one call per segment.
    Raises ValueError for an architecture whose layers do not have the llama layout.
    """

    def __init__(self, model, packed: bool | None = None, max_positions: int | None = None,
                 row_padding: dict[int, int] | None = None, gqa_packing: frozenset[int] | set[int] | None = None,
                 batch_decode: bool = True):
        cfg = model.config
        self.batch_decode = bool(batch_decode)
        dec = model.get_decoder()
        self.config = cfg
        self.num_layers = len(dec.layers)
        self.hq = int(cfg.num_attention_heads)
        self.hkv = int(getattr(cfg, "num_key_value_heads", None) or self.hq)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq)
        self.scale = self.head_dim ** -0.5
        self.dtype = model.dtype
        self.device = model.device
        first = dec.layers[0]
        if not all(hasattr(first.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(first.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"architecture '{cfg.model_type}' does not have the llama layer layout")
        if str(getattr(cfg, "hidden_act", "silu")) != "silu":
            raise ValueError(f"hidden_act '{cfg.hidden_act}' is not supported (silu only)")
        self.eps = float(first.input_layernorm.variance_epsilon)
        self.embed = dec.embed_tokens.weight
        # Per layer, (weight, bias) of the four linears: q/k/v and gate/up fused.
        linears = []
        for layer in dec.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_b = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            linears.append(((torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), qkv_b),
                            (a.o_proj.weight, a.o_proj.bias),
                            (torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None),
                            (mlp.down_proj.weight, None)))
        if packed is None:
            packed = choose_packing([w for four in linears for w, _ in four])
        self.packed = bool(packed)
        self.layers = []
        for layer, four in zip(dec.layers, linears):
            qkv, o, gate_up, down = (Linear(w, b, packed=self.packed) for w, b in four)
            qn = getattr(layer.self_attn, "q_norm", None)
            kn = getattr(layer.self_attn, "k_norm", None)
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight, qkv=qkv, q_norm=None if qn is None else qn.weight,
                k_norm=None if kn is None else kn.weight, o=o, ln2=layer.post_attention_layernorm.weight,
                gate_up=gate_up, down=down))
        self.intermediate = self.layers[0].gate_up.out_features // 2
        self.norm = dec.norm.weight
        self.lm_head = Linear(model.get_output_embeddings().weight, None, packed=self.packed)
        stack = [lin for lay in self.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [self.lm_head]
        if row_padding is None:
            row_padding = choose_row_padding(stack) if self.packed else {}
        self.row_padding = dict(row_padding)
        for lin in stack:
            lin.row_padding = self.row_padding
        if gqa_packing is None:
            gqa_packing = choose_gqa_packing(self.dtype, self.hq, self.hkv, self.head_dim, self.device)
        self.gqa_packing = frozenset(gqa_packing)
        if max_positions is None:
            max_positions = int(getattr(cfg, "max_position_embeddings", 2048)) + TREE_HEADROOM
        self.max_positions = int(max_positions)
        positions = torch.arange(self.max_positions, device=self.device)[None]
        with torch.inference_mode():
            cos, sin = dec.rotary_emb(self.embed[:1], positions)
        self.cos, self.sin = cos[0], sin[0]  # [capacity, head_dim], the model's dtype

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' RMSNorm (statistics in float32, scaled in the input dtype); in float32
        # the fused op gives the same values in one dispatch.
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def new_pool(self, slots: int, capacity: int) -> KVPool:
        """A KVPool shaped for this target (its dtype and device). Raises ValueError when
        capacity exceeds the positions the rotary tables cover."""
        if capacity > self.max_positions:
            raise ValueError(f"a KV capacity of {capacity} exceeds the {self.max_positions} positions covered")
        return KVPool(self.num_layers, slots, self.hkv, capacity, self.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def __call__(self, pool: KVPool, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                 feature_layers: tuple[int, ...] = (), last_only: bool = False, backend: str = "sdpa",
                 logit_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the target over the segments' new tokens, writing their keys and values into `pool`.

        tokens, positions: [N] int64 on the model's device (N = sum of segment n, segment
        order; positions are start + depth for a tree, start + i for causal tokens).
        backend: the tree attention backend (engine.attention.BACKENDS).
        feature_layers: hidden-state indices to return (0 = embeddings, l = decoder layer l's
        output, L = the final norm's output). last_only: logits of each segment's last row only.
        logit_rows: int64 [R] row indices whose logits are wanted (a teacher-forced pass that
        scores only response positions); overrides last_only.
        Returns (logits [rows, V]: N rows, len(segments) with last_only, R with logit_rows;
        features [N, len(feature_layers) * H] or None).
        Raises CacheCapacityError (engine.kv_cache) before any write when a segment does not
        fit its slot, ValueError when the rows and segments disagree or a feature layer is
        outside 0..L.
        """
        N = int(tokens.shape[0])
        if sum(s.n for s in segments) != N:
            raise ValueError(f"{N} tokens for segments of {sum(s.n for s in segments)} rows")
        # Per segment, views of its slot for all layers, taken once (and checked before any write).
        views = [pool.slot_views(s.slot, s.start + s.n) for s in segments]
        hq, hkv, d = self.hq, self.hkv, self.head_dim
        want = set(feature_layers)
        if any(not 0 <= j <= self.num_layers for j in want):
            raise ValueError(f"feature layers {sorted(want)} are outside 0..{self.num_layers} for this target")
        kept: dict[int, torch.Tensor] = {}
        x = F.embedding(tokens, self.embed)
        if 0 in want:
            kept[0] = x
        cos = self.cos[positions][:, None]  # [N, 1, d]
        sin = self.sin[positions][:, None]
        write = self._write_index(segments) if len(segments) > 1 else None
        decode = self._decode_batch(segments) if write is not None and self.batch_decode else None
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.ln1)
            qkv = layer.qkv(h).view(N, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            if layer.q_norm is not None:
                q, k = self._rms(q, layer.q_norm), self._rms(k, layer.k_norm)
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            else:  # one rotation over the q and k heads together
                qk = self._rope(qkv[:, :hq + hkv], cos, sin)
                q, k = qk[:, :hq], qk[:, hq:]
            if write is not None:  # every segment's new rows in one scatter per tensor
                pool.keys[i].index_put_(write, k)
                pool.values[i].index_put_(write, v)
            attn = self._attention(i, q, k, v, pool, segments, views, write is not None, decode, backend)
            x = x + layer.o(attn)
            h = self._rms(x, layer.ln2)
            gu = layer.gate_up(h)
            x = x + layer.down(F.silu(gu[:, :self.intermediate]) * gu[:, self.intermediate:])
            if i + 1 in want and i + 1 < self.num_layers:
                kept[i + 1] = x
        x = self._rms(x, self.norm)
        if self.num_layers in want:
            kept[self.num_layers] = x
        if logit_rows is not None:
            x = x[logit_rows]
        elif last_only:
            ends = list(itertools.accumulate(s.n for s in segments))
            x = x[-1:] if len(segments) == 1 else x[torch.tensor(ends, device=x.device) - 1]
        logits = self.lm_head(x)
        feats = torch.cat([kept[j] for j in feature_layers], dim=-1) if feature_layers else None
        return logits, feats

    def _attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool,
                   segments: list[Segment], views: list, written: bool,
                   decode: DecodeBatch | None, backend: str) -> torch.Tensor:
        """Layer i's attention output [N, hq * d] for the forward's rows (q [N, hq, d]; k, v
        [N, hkv, d], already in the pool when `written`, else copied into each segment's slot here).
        decode: `_decode_batch`, which then covers every one-token causal segment."""
        hq, d = self.hq, self.head_dim
        decode_out = None if decode is None else decode(q, pool.keys[i], pool.values[i], self.scale)
        if decode is not None and decode.rows == len(segments):
            return decode_out  # every segment a decode row, in segment order
        outs = []
        row = decoded = 0
        for s, (all_keys, all_values) in zip(segments, views):
            end = row + s.n
            if decode is not None and self._is_decode_row(s):
                outs.append(decode_out[decoded:decoded + 1])
                decoded += 1
                row = end
                continue
            keys, values = all_keys[i], all_values[i]
            if not written:
                keys[:, s.start:].copy_(k[row:end].transpose(0, 1))
                values[:, s.start:].copy_(v[row:end].transpose(0, 1))
            qs = q[row:end].transpose(0, 1)[None]
            if s.n in self.gqa_packing and (s.tree is None or backend == "sdpa"):
                if s.tree is not None:
                    mask = s.tree.visible()
                else:
                    mask = None if s.n == 1 else causal_mask(s.n, s.start + s.n, qs.device)
                o = packed_gqa_attention(qs, keys[None], values[None], self.scale, mask)
            elif s.tree is None:
                o = causal_attention(qs, keys[None], values[None], self.scale)
            else:
                o = tree_attention(backend, qs, keys[None], values[None], s.tree, self.scale)
            outs.append(o[0].transpose(0, 1).reshape(s.n, hq * d))
            row = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _is_decode_row(s: Segment) -> bool:
        """One causal token: a row `_decode_batch` plans into its single attention call."""
        return s.n == 1 and s.tree is None

    def _decode_batch(self, segments: list[Segment]) -> DecodeBatch | None:
        """The DecodeBatch of every segment that is one causal token, or None when fewer than two
        are or their slots are too spread out (DecodeBatch.plan)."""
        rows = list(itertools.accumulate((s.n for s in segments), initial=0))
        picked = [(s, r) for s, r in zip(segments, rows) if self._is_decode_row(s)]
        if len(picked) < 2:
            return None
        return DecodeBatch.plan([s.slot for s, _ in picked], [s.start + 1 for s, _ in picked],
                                [r for _, r in picked], self.device)

    def _write_index(self, segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Indices (slot [N, 1], head [1, h_kv], position [N, 1]) that scatter the N new rows'
        keys [N, h_kv, d] into one layer's [slots, h_kv, capacity, d] pool tensor."""
        slots, pos = [], []
        for s in segments:
            slots += [s.slot] * s.n
            pos += range(s.start, s.start + s.n)
        dev = self.device
        return (torch.tensor(slots, device=dev)[:, None], torch.arange(self.hkv, device=dev)[None],
                torch.tensor(pos, device=dev)[:, None])


_FORWARDS: dict[int, tuple[object, TargetForward]] = {}
_FORWARDS_LOCK = threading.Lock()


def target_forward_for(model) -> TargetForward:
    """The TargetForward of `model` in its current dtype and device, built on first use (weights
    fused and packed once per model, dtype and device)."""
    with _FORWARDS_LOCK:
        entry = _FORWARDS.get(id(model))
        # Rebuilt for a model that is gone (its id reused) or moved to another dtype or device.
        if entry is None or entry[0] is not model or (entry[1].dtype, entry[1].device) != (model.dtype, model.device):
            entry = _FORWARDS[id(model)] = (model, TargetForward(model))
        return entry[1]
