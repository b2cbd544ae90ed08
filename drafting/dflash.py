"""DFlash block-diffusion drafter: the published checkpoint format (docs/method.md, section 2) and its forward pass.

The drafter reads the target's hidden states at a few layers (context features),
embeds the block [root, MASK, ..., MASK] with the target's own input embedding,
and in one pass emits position-wise marginals q_1..q_{B-1} through the target's
lm_head. Queries come from the block only; keys and values are the context
features' projections followed by the block's, with no mask (the block is
bidirectional). Only context entries are kept in the drafter's KV cache.

Optional extensions (absent from published z-lab checkpoints, which load unchanged):
- `dflash_config.inject_anchor` (bool): add the context feature of the position
  before the anchor to every block input (EAGLE-style feature injection).
- `dflash_config.draft_vocab_size` (int) with a `d2t` int64 tensor [Vd] in the
  safetensors file: the drafter scores only those target token ids (EAGLE-3's
  reduced vocabulary), sharing the rows of the target's lm_head.
"""
from __future__ import annotations

import itertools
import time
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from drafting.base import Drafter
from drafting.proposal import Marginals

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DrafterLoadError(ValueError):
    """A drafter checkpoint is missing, malformed, or does not fit the target."""


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Target layers read by the drafter when the config does not list them (docs/method.md, section 2).

    n is the number of layers read (the drafter's own layer count in published configs).

    One layer -> [L_t // 2]; otherwise round(1 + i * (L_t - 4) / (n - 1)) for i = 0..n-1.
    """
    if n == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]


@dataclass
class DFlashSpec:
    """Parsed drafter configuration: the Qwen3 config plus the DFlash fields."""

    config: Qwen3Config
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    inject_anchor: bool = False
    draft_vocab_size: int | None = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashSpec":
        """Parse a config.json dict. Raises DrafterLoadError naming missing fields."""
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "block_size") if k not in d]
        dcfg = d.get("dflash_config") or {}
        if "mask_token_id" not in dcfg:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise DrafterLoadError(f"drafter config lacks required field(s): {', '.join(missing)}")
        qcfg = {k: v for k, v in d.items() if k not in ("dflash_config", "architectures", "auto_map")}
        config = Qwen3Config(**qcfg)
        ids = dcfg.get("target_layer_ids")
        ntl = int(d.get("num_target_layers", 0))
        if ids is None:
            if not ntl:
                raise DrafterLoadError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
            # One feature layer per draft layer: for 5 layers over 36 this gives [1, 9, 17, 25, 33].
            ids = default_target_layer_ids(ntl, int(d["num_hidden_layers"]))
        return cls(
            config=config,
            block_size=int(d["block_size"]),
            num_target_layers=ntl,
            mask_token_id=int(dcfg["mask_token_id"]),
            target_layer_ids=[int(i) for i in ids],
            inject_anchor=bool(dcfg.get("inject_anchor", False)),
            draft_vocab_size=dcfg.get("draft_vocab_size"),
            raw=d,
        )

    def to_dict(self) -> dict:
        d = self.config.to_dict()
        for k in ("transformers_version", "dtype", "torch_dtype"):
            d.pop(k, None)
        d["architectures"] = ["DFlashDraftModel"]
        d["block_size"] = self.block_size
        d["num_target_layers"] = self.num_target_layers
        dc = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.inject_anchor:
            dc["inject_anchor"] = True
        if self.draft_vocab_size:
            dc["draft_vocab_size"] = int(self.draft_vocab_size)
        d["dflash_config"] = dc
        return d


class DFlashAttention(nn.Module):
    """Attention with queries from the block and keys/values from context + block.

    Weights: q_proj [n_q*d, H], k_proj/v_proj [n_kv*d, H], o_proj [H, n_q*d],
    q_norm/k_norm per-head RMSNorm [d].
    """

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_q, self.n_kv, self.d = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_q * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_q * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, n, H] -> rotated keys and values [b, n_kv, n, d]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.d).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [b, B, H] normed block states; cos/sin [b, B, d]; ctx_k/ctx_v [b, n_kv, c, d].

        attn_mask: optional [b or 1, 1, B, c + B] bool (True = visible), used in training;
        None at inference (block queries see the whole context and the whole block).
        Returns [b, B, H].
        """
        kb, vb = self.project_kv(x, cos, sin)
        return self.attend(x, cos, sin, torch.cat([ctx_k, kb], dim=2), torch.cat([ctx_v, vb], dim=2), attn_mask)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's queries (from x [b, B, H]) over keys/values k, v [b, n_kv, m, d] that already
        hold the context and the block's own entries. Returns [b, B, H]."""
        out = F.scaled_dot_product_attention(self.queries(x, cos, sin), k, v, attn_mask=attn_mask,
                                             enable_gqa=self.n_q != self.n_kv)
        return self.output(out)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, B, H] -> rotated queries [b, n_q, B, d]."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_q, self.d)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        return q

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [b, n_q, B, d] -> [b, B, H] through o_proj."""
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.n_q * self.d))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention (block queries over context + block) then gated MLP."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DFlashModel(nn.Module):
    """The drafter's own weights, with exactly the published key names (no embedding, no lm_head).

    fc: [H, n_ids * H_t] fuses the target features; hidden_norm and norm are RMSNorms.
    Optional buffer d2t [Vd] (reduced vocabulary extension).
    """

    def __init__(self, spec: DFlashSpec, target_hidden: int | None = None):
        super().__init__()
        cfg = spec.config
        self.spec = spec
        th = target_hidden or cfg.hidden_size
        self.fc = nn.Linear(len(spec.target_layer_ids) * th, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        if spec.draft_vocab_size:
            self.register_buffer("d2t", torch.zeros(int(spec.draft_vocab_size), dtype=torch.long))
        else:
            self.d2t = None

    def context_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """[b, n, n_ids * H_t] concatenated target hidden states -> [b, n, H] normalised context."""
        return self.hidden_norm(self.fc(target_features))

    def forward_block(
        self,
        block_embeds: torch.Tensor,
        block_pos: torch.Tensor,
        ctx: torch.Tensor,
        ctx_pos: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Run the block through every layer.

        block_embeds [b, B, H]; block_pos [b, B] absolute positions; ctx [b, n, H] new
        normalised context features at positions ctx_pos [b, n]; past: per-layer cached
        context (k, v) [b, n_kv, c, d] or None. attn_mask: see DFlashAttention.
        Returns final-normed block states [b, B, H] and the per-layer context (k, v)
        including the new context (block entries are never cached).
        """
        cos_b, sin_b = self.rotary_emb(block_embeds, block_pos)
        cos_c, sin_c = self.rotary_emb(ctx, ctx_pos)
        h = block_embeds
        new_past = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kc, vc = attn.project_kv(ctx, cos_c, sin_c)
            if past is not None and past[i][0].shape[2] > 0:
                kc = torch.cat([past[i][0], kc], dim=2)
                vc = torch.cat([past[i][1], vc], dim=2)
            new_past.append((kc, vc))
            h = h + attn(layer.input_layernorm(h), cos_b, sin_b, kc, vc, attn_mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h), new_past

    def forward_blocks_cached(self, block_embeds: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor,
                              ctx_pos: torch.Tensor, ctx_rows: list[int], caches: list["ContextCache"]) -> torch.Tensor:
        """`forward_block` at inference for b requests at once, each over its in-place ContextCache.

        block_embeds [b, B, H] at positions block_pos [b, B]; ctx [N, H]: every request's new
        context rows back to back (ctx_rows[r] of them for request r) at positions ctx_pos [N].
        Request r's new context goes to its cache at [length, length + ctx_rows[r]) and its
        block's keys right after as scratch. The projections and the MLP run once over all
        rows (the weights are read once per batch); attention is per request, over its own
        cache. Every block query sees its request's whole context and whole block (no mask).
        Caches' lengths advance by ctx_rows. Returns final-normed block states [b, B, H].
        """
        b, B = block_embeds.shape[:2]
        cos_b, sin_b = self.rotary_emb(block_embeds, block_pos)
        n_ctx = int(ctx.shape[0])
        if n_ctx:
            cos_c, sin_c = self.rotary_emb(ctx[None], ctx_pos[None])
        starts = [c.length for c in caches]
        offsets = [0]
        for n in ctx_rows:
            offsets.append(offsets[-1] + n)
        for cache, c0, n in zip(caches, starts, ctx_rows):
            cache.reserve(c0 + n + B)
        h = block_embeds
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            if n_ctx:
                kc, vc = attn.project_kv(ctx[None], cos_c, sin_c)  # [1, n_kv, N, d]
            kb, vb = attn.project_kv(x, cos_b, sin_b)  # [b, n_kv, B, d]
            q = attn.queries(x, cos_b, sin_b)
            outs = []
            for r, (cache, c0, n) in enumerate(zip(caches, starts, ctx_rows)):
                keys, values = cache.keys[i], cache.values[i]
                if n:
                    keys[:, c0:c0 + n] = kc[0, :, offsets[r]:offsets[r + 1]]
                    values[:, c0:c0 + n] = vc[0, :, offsets[r]:offsets[r + 1]]
                end = c0 + n + B
                keys[:, c0 + n:end] = kb[r]
                values[:, c0 + n:end] = vb[r]
                outs.append(F.scaled_dot_product_attention(q[r:r + 1], keys[None, :, :end], values[None, :, :end],
                                                           enable_gqa=attn.n_q != attn.n_kv))
            h = h + attn.output(outs[0] if b == 1 else torch.cat(outs))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for cache, c0, n in zip(caches, starts, ctx_rows):
            cache.length = c0 + n
        return self.norm(h)


class ContextCache:
    """The drafter's context keys and values for one request, written in place.

    keys, values: [layers, n_kv, capacity, d]; positions [0, length) hold the context, and
    a block's B entries are written right after them as scratch (overwritten by the next
    block, never counted). The capacity doubles when context + block would not fit, so a
    request of n tokens reallocates O(log n) times instead of concatenating every step.
    """

    def __init__(self, layers: int, n_kv: int, d: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        self.keys = torch.empty((layers, n_kv, capacity, d), dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def reserve(self, total: int) -> None:
        """Make room for `total` positions, keeping the cached context."""
        if total <= self.capacity:
            return
        cap = self.capacity
        while cap < total:
            cap *= 2
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:2] + (cap,) + old.shape[3:])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


@dataclass
class DFlashState:
    """Per-request drafter state: the context cache and features not yet consumed."""

    cache: ContextCache | None = None
    ctx_len: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    last_ctx: torch.Tensor | None = None  # [1, 1, H] normalised feature of the last context token


class DFlashDrafter(Drafter):
    """A DFlash drafter bound to its target (shares the target's embedding and lm_head).

    model: DFlashModel; embed: the target's input embedding; lm_head: the target's
    output projection (weight [V, H]). top_k: tokens kept per depth in the marginals.
    """

    def __init__(self, model: DFlashModel, embed: nn.Module, lm_head: nn.Module, top_k: int = 128):
        self.model = model
        self.embed = embed
        self.lm_head = lm_head
        self.spec = model.spec
        self.block_size = self.spec.block_size
        self.max_depth = self.block_size - 1
        self.feature_layers = tuple(i + 1 for i in self.spec.target_layer_ids)
        self.top_k = top_k
        self.refresh_head()

    def refresh_head(self) -> None:
        """Cache the lm_head rows the drafter scores (all, or the reduced vocabulary d2t), in the
        drafter's dtype (a copy when it is not the target's)."""
        w = self.lm_head.weight
        d2t = self.model.d2t
        w = w if d2t is None else w.index_select(0, d2t.to(w.device))
        self._head_w = w.to(self.model.fc.weight.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the drafter computes in (its weights'; the target's features are cast to it)."""
        return self.model.fc.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Convert the drafter's own weights to `dtype` (its context caches start over: call
        between requests). The target is not touched: its embedding and lm_head are read in
        its dtype and cast. A drafter's numerics never change what is emitted (verification
        decides), only how often its proposals are accepted. Converting down and back rounds
        the weights: `choose_drafter_dtype` times copies instead."""
        self.model.to(dtype=dtype)
        if self.model.d2t is not None:
            self.model.d2t = self.model.d2t.long()
        self.refresh_head()

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    def new_state(self) -> DFlashState:
        return DFlashState()

    def linear_layers(self) -> list[nn.Module]:
        """Every nn.Linear of the drafter model: the context rows they project vary with the
        tokens committed since the last pass."""
        return [mod for mod in self.model.modules() if isinstance(mod, nn.Linear)]

    def extend(self, state: DFlashState, token_ids: list[int], features: torch.Tensor | None) -> None:
        if features is None:
            raise ValueError("the DFlash drafter needs target features for every committed token")
        if features.shape[0] != len(token_ids):
            raise ValueError(f"got {features.shape[0]} feature rows for {len(token_ids)} tokens")
        state.pending.append(features)

    def propose(self, state: DFlashState, root: int, max_depth: int) -> Marginals:
        """One drafter pass: consume pending context, run the block, return top-K marginals.

        Returns Marginals with token_ids/logprobs [min(max_depth, B-1), top_k] on the drafter's device.
        """
        return self.propose_batch([state], [root], [max_depth])[0]

    @torch.inference_mode()
    def propose_batch(self, states: list[DFlashState], roots: list[int], max_depths: list[int]
                      ) -> list[Marginals | Exception]:
        """One drafter pass over b requests' blocks together (`DFlashModel.forward_blocks_cached`).

        Each request's pending context is consumed and its block [root, MASK, ...] drafted; the
        states change only once the pass has succeeded, so a failed pass (raised) can be retried.
        Returns b Marginals (token_ids/logprobs [min(max_depths[r], B-1), top_k]) on the
        drafter's device.
        """
        m = self.model
        dev, dt = self.device, m.fc.weight.dtype
        B, b = self.block_size, len(states)
        rows = [sum(int(f.shape[0]) for f in st.pending) for st in states]
        pending = [f for st in states for f in st.pending]
        if pending:
            ctx = m.context_features(torch.cat(pending, dim=0).to(dev, dt)[None])[0]  # [N, H]
        else:
            ctx = torch.zeros((0, m.fc.out_features), device=dev, dtype=dt)
        ctx_pos = torch.cat([torch.arange(st.ctx_len, st.ctx_len + n, device=dev) for st, n in zip(states, rows)])
        starts = [st.ctx_len + n for st, n in zip(states, rows)]
        ids = torch.full((b, B), self.spec.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor(roots, dtype=torch.long, device=dev)
        x = self.embed(ids).to(dt)
        ends = list(itertools.accumulate(rows))
        last = [ctx[e - 1:e][None] if n else st.last_ctx for st, n, e in zip(states, rows, ends)]
        if self.spec.inject_anchor:
            anchor = torch.stack([torch.zeros_like(x[0, :1]) if a is None else a[0] for a in last])
            x = x + anchor
        block_pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(B, device=dev)[None]
        cfg = m.spec.config
        for st in states:
            if st.cache is None:
                st.cache = ContextCache(len(m.layers), cfg.num_key_value_heads, cfg.head_dim, dt, dev)
        h = m.forward_blocks_cached(x, block_pos, ctx, ctx_pos, rows, [st.cache for st in states])
        for st, start, a in zip(states, starts, last):
            st.pending, st.ctx_len, st.last_ctx = [], start, a
        depths = [max(0, min(d, B - 1)) for d in max_depths]
        deepest = max(depths)
        lp = torch.log_softmax(F.linear(h[:, 1:1 + deepest], self._head_w).float(), dim=-1)
        k = min(self.top_k, lp.shape[-1])
        vals, idx = torch.topk(lp, k, dim=-1)
        if m.d2t is not None:
            idx = m.d2t[idx]
        # Left on the drafter's device: the tree builder moves both in one transfer (Marginals.to_host).
        return [Marginals(token_ids=idx[r, :d], logprobs=vals[r, :d]) for r, d in enumerate(depths)]


def read_spec(path: str | Path) -> DFlashSpec:
    """Read and parse `config.json` of a drafter folder. Raises DrafterLoadError."""
    p = Path(path) / CONFIG_NAME
    if not p.is_file():
        raise DrafterLoadError(f"drafter folder '{path}' has no {CONFIG_NAME}")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise DrafterLoadError(f"drafter config '{p}' is not valid JSON: {e}") from e
    return DFlashSpec.from_dict(d)


def check_fits_target(spec: DFlashSpec, target_config) -> list[str]:
    """Mismatches between a drafter config and the target config (empty when it fits)."""
    problems = []
    lt = int(target_config.num_hidden_layers)
    if spec.num_target_layers and spec.num_target_layers != lt:
        problems.append(f"num_target_layers={spec.num_target_layers} but the target has {lt} layers")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < lt]
    if bad:
        problems.append(f"target_layer_ids {bad} outside the target's 0..{lt - 1}")
    if spec.config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size={spec.config.hidden_size} but the target's is {target_config.hidden_size}")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        problems.append(f"mask_token_id={spec.mask_token_id} outside the target's vocabulary of {target_config.vocab_size}")
    if spec.block_size < 2:
        problems.append(f"block_size={spec.block_size} must be >= 2")
    return problems


def _resolve_folder(spec: str | Path) -> Path:
    p = Path(spec).expanduser()
    if p.is_dir():
        return p
    s = str(spec)
    if p.exists():
        raise DrafterLoadError(f"drafter '{s}' is a file; expected a folder with {CONFIG_NAME} and {WEIGHTS_NAME}")
    parts = s.split("/")
    if len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(s, allow_patterns=[CONFIG_NAME, WEIGHTS_NAME]))
        except Exception as e:
            raise DrafterLoadError(f"could not fetch drafter '{s}' from the Hugging Face hub: {e}") from e
    raise DrafterLoadError(f"drafter '{s}' is neither an existing folder nor a Hugging Face id of the form org/name")


def load_dflash(path: str | Path, target_model: nn.Module, top_k: int = 128,
                dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a DFlash checkpoint (folder or hub id) for `target_model`.

    Checks the config against the target and every weight key and shape against the
    module; raises DrafterLoadError listing all mismatches. The drafter runs on the
    target's device, in `dtype` (None: the target's; see `choose_drafter_dtype`).
    """
    from safetensors.torch import load_file

    folder = _resolve_folder(path)
    spec = read_spec(folder)
    tcfg = target_model.config
    problems = check_fits_target(spec, tcfg)
    if problems:
        raise DrafterLoadError(f"drafter '{path}' does not fit the target: " + "; ".join(problems))
    wfile = folder / WEIGHTS_NAME
    if not wfile.is_file():
        raise DrafterLoadError(f"drafter folder '{path}' has no {WEIGHTS_NAME}")
    state = load_file(str(wfile))
    model = DFlashModel(spec, target_hidden=tcfg.hidden_size)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    errs = [f"missing {k} {expected[k]}" for k in expected if k not in got]
    errs += [f"unexpected {k} {got[k]}" for k in got if k not in expected]
    errs += [f"{k}: file {got[k]} vs expected {expected[k]}" for k in expected if k in got and got[k] != expected[k]]
    if errs:
        raise DrafterLoadError(f"drafter weights in '{wfile}' do not match its config: " + "; ".join(errs))
    model.load_state_dict(state)
    p = next(target_model.parameters())
    model.to(device=p.device, dtype=dtype or p.dtype).eval().requires_grad_(False)
    if model.d2t is not None:
        model.d2t = model.d2t.long()
    return DFlashDrafter(model, target_model.get_input_embeddings(), target_model.get_output_embeddings(), top_k=top_k)


def time_drafter_pass(drafter: DFlashDrafter, context: int = 64, rows: int = 2, repeats: int = 8,
                      evict_mb: int = 256) -> float:
    """Seconds of one steady-state drafter pass: a fresh state is given `context` feature rows and
    drafted once (untimed), then `repeats` passes each after `rows` new rows (a step's
    accepted tokens) are timed, and the fastest kept. Features are random: a pass's cost does
    not depend on their values. Before each timed pass `evict_mb` MB are read, as the target's
    verification reads its weights between two drafter passes: with its weights (and the
    49k-row scoring head) left in the CPU's caches a pass took 8.5 ms in float32 and in
    bfloat16 alike, where in decoding it took 13.5 and 9.0 ms (2-core EPYC, no AMX)."""
    gen = torch.Generator().manual_seed(0)
    evict = torch.ones(max(evict_mb, 0) << 18) if evict_mb > 0 else None  # float32: 4 bytes each
    width = drafter.model.fc.in_features
    st = drafter.new_state()
    dev = drafter.device
    feats = lambda n: torch.randn(n, width, generator=gen).to(dev)
    drafter.extend(st, [0] * context, feats(context))
    drafter.propose(st, 0, drafter.max_depth)
    best = float("inf")
    for _ in range(repeats):
        drafter.extend(st, [0] * rows, feats(rows))
        if evict is not None:
            evict.sum()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        m = drafter.propose(st, 0, drafter.max_depth)
        m.logprobs.cpu()  # the pass is done when its result is readable
        best = min(best, time.perf_counter() - t0)
    return best


#: A candidate dtype must make the drafter's pass this much faster to replace the target's.
DRAFTER_DTYPE_MARGIN = 0.9


def choose_drafter_dtype(drafter: DFlashDrafter, candidates: tuple[torch.dtype, ...] = (torch.bfloat16,),
                         margin: float = DRAFTER_DTYPE_MARGIN) -> tuple[torch.dtype, dict[str, float]]:
    """Run the drafter in the dtype whose pass is cheapest here, by measurement.

    The drafter's current dtype (the target's, as loaded) competes with `candidates`, each
    timed on a converted copy (`time_drafter_pass`), so the loaded weights are never rounded by
    a trial; a candidate wins only when its pass takes under `margin` times the current one's.
    The drafter is converted once, to the winner (`to_dtype`). Returns (dtype, {name: seconds}).
    Measured on a 2-core EPYC with avx512_bf16 and no AMX, float32 target: a pass of the
    shipped 2-layer drafter took 13.5 ms in float32 and 9.0 ms in bfloat16 (medians over a
    benchmark's steps) with the same 1.34-1.38 tokens a drafted step (docs/controller.md).
    """
    import copy

    current = drafter.dtype
    best, best_t = current, time_drafter_pass(drafter)
    times = {current: best_t}
    for dt in candidates:
        if dt == current:
            continue
        trial = DFlashDrafter(copy.deepcopy(drafter.model), drafter.embed, drafter.lm_head, top_k=drafter.top_k)
        trial.to_dtype(dt)
        times[dt] = t = time_drafter_pass(trial)
        if t < margin * best_t:
            best, best_t = dt, t
    if best != current:
        drafter.to_dtype(best)
    return best, {str(dt).removeprefix("torch."): t for dt, t in times.items()}


def save_dflash(model: DFlashModel, path: str | Path) -> None:
    """Write config.json + model.safetensors in the published format (plus optional extensions)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(model.spec.to_dict(), indent=2))
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(sd, str(out / WEIGHTS_NAME), metadata={"format": "pt"})


def make_spec_for_target(
    target_config,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int = 0,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    inject_anchor: bool = False,
    draft_vocab_size: int | None = None,
) -> DFlashSpec:
    """A drafter config shaped for `target_config` (same hidden size, heads, RoPE), for new drafters."""
    lt = int(target_config.num_hidden_layers)
    ids = target_layer_ids or default_target_layer_ids(lt, 3 if lt >= 8 else 1)
    h = target_config.hidden_size
    nq = target_config.num_attention_heads
    rp = getattr(target_config, "rope_parameters", None) or {}
    d = {
        "hidden_size": h,
        "intermediate_size": intermediate_size or target_config.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": nq,
        "num_key_value_heads": target_config.num_key_value_heads,
        "head_dim": getattr(target_config, "head_dim", None) or h // nq,
        "rms_norm_eps": float(target_config.rms_norm_eps),
        "rope_theta": float(rp.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
        "vocab_size": target_config.vocab_size,
        "max_position_embeddings": target_config.max_position_embeddings,
        "block_size": block_size,
        "num_target_layers": lt,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids},
    }
    if inject_anchor:
        d["dflash_config"]["inject_anchor"] = True
    if draft_vocab_size:
        d["dflash_config"]["draft_vocab_size"] = draft_vocab_size
    return DFlashSpec.from_dict(d)


def random_dflash(target_model: nn.Module, seed: int = 0, **spec_kwargs) -> DFlashDrafter:
    """A randomly initialised drafter for `target_model` (tests and training start points)."""
    spec = make_spec_for_target(target_model.config, **spec_kwargs)
    torch.manual_seed(seed)
    model = DFlashModel(spec, target_hidden=target_model.config.hidden_size)
    std = 0.02
    for name, prm in model.named_parameters():
        if prm.dim() == 2:
            nn.init.normal_(prm, std=std)
    p = next(target_model.parameters())
    model.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    return DFlashDrafter(model, target_model.get_input_embeddings(), target_model.get_output_embeddings())
