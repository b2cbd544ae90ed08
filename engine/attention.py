"""Tree attention for verification, called by the engine's own forward (engine.forward).

A verification forward attends from n tree nodes over the c cached prefix tokens and the
n nodes themselves: row i sees the whole prefix, node i and its ancestors (docs/method.md,
section 5). The forward writes the nodes' keys behind the prefix in the KV slot and calls
`tree_attention(backend, q, k, v, tree, scale)` with a `TreeAttention` describing the tree.

Backends (public names):
    sdpa        torch scaled_dot_product_attention with a boolean mask built on the device
    flex        torch FlexAttention with a BlockMask built from the tree (the prefix blocks
                are full, the tree blocks evaluate the ancestor relation); compiled on CUDA,
                eager (an unfused reference) on CPU unless BASTION_FLEX_COMPILE=1
    flash_attn  flash-attn over the prefix (no mask, returns the log-sum-exp) plus a small
                masked attention over the tree keys, merged exactly by log-sum-exp; only
                when the flash-attn package is importable and the device is CUDA

Without a tree (prefill, the one-token AR step) `causal_attention` runs plain SDPA, with a
lower-right causal mask when s new tokens follow a non-empty cache.

With grouped-query heads, a few query rows can also run as one group's heads stacked into
rows (`packed_gqa_attention`): the CPU's SDPA kernel is much faster for 3 rows than for 1 in
bfloat16 (a one-token step over 512 cached tokens: 290 us a layer against 73 us packed on a
2-core EPYC), slower in float32 at one row. `choose_gqa_packing` measures where it pays.
"""
from __future__ import annotations

import importlib
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

#: Public backend names, in order of preference when timings tie.
BACKENDS = ("sdpa", "flex", "flash_attn")
#: FlexAttention's default block size (tokens per block in the BlockMask).
FLEX_BLOCK = 128


def check_backend(backend: str) -> str:
    """`backend` itself when it is a public backend name; raises ValueError otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend '{backend}' (choose from {', '.join(BACKENDS)} or auto)")
    return backend


# ---- the tree structure, on the device ------------------------------------------------------

def ancestor_matrix_device(parents: torch.Tensor, max_depth: int, device: torch.device | str,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, n] bool on `device`: (i, j) True when node j is node i or one of its ancestors.

    parents: [n] int64 (parents[0] = -1, a parent precedes its children); max_depth: the
    tree's depth (known on the host, so no device sync). Built with max_depth + 1 scatters.
    out: optional preallocated [n, n] bool on `device` (may be a view of a larger buffer);
    it is cleared and filled, and returned.
    """
    par = parents.to(device, non_blocking=True)
    n = par.shape[0]
    idx = torch.arange(n, device=device)
    if out is None:
        anc = torch.zeros((n, n), dtype=torch.bool, device=device)
    else:
        anc = out.zero_()
    cur = idx
    for _ in range(max_depth + 1):
        anc.scatter_(1, cur[:, None], True)
        nxt = par[cur]
        # Past the root: point at the row itself (already True) instead of branching.
        cur = torch.where(nxt >= 0, nxt, idx)
    return anc


@dataclass
class TreeAttention:
    """The tree of one verification forward, as the attention backends need it.

    prefix_len: c cached tokens before the tree; ancestors: [n, n] bool on the device.
    Derived masks are built once on first use and shared by all layers of the forward.
    """

    prefix_len: int
    ancestors: torch.Tensor
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return int(self.ancestors.shape[0])

    @classmethod
    def from_parents(cls, parents: torch.Tensor, prefix_len: int, device: torch.device | str,
                     max_depth: int | None = None) -> "TreeAttention":
        """From host parents [n] (max_depth defaults to n - 1, a safe upper bound)."""
        depth = parents.shape[0] - 1 if max_depth is None else max_depth
        return cls(prefix_len, ancestor_matrix_device(parents, depth, device))

    @classmethod
    def from_tree(cls, tree, prefix_len: int, device: torch.device | str) -> "TreeAttention":
        """From an engine.tree.Tree (host tensors) verified over prefix_len cached tokens."""
        return cls.from_parents(tree.parents, prefix_len, device, int(tree.depths.max()) if tree.size else 0)

    def visible(self) -> torch.Tensor:
        """[1, 1, n, c + n] bool: True where row i may attend."""
        if "visible" not in self._memo:
            n, c = self.n, self.prefix_len
            vis = torch.ones((n, c + n), dtype=torch.bool, device=self.ancestors.device)
            vis[:, c:] = self.ancestors
            self._memo["visible"] = vis[None, None]
        return self._memo["visible"]

    def block_mask(self, block_size: int = FLEX_BLOCK):
        """FlexAttention BlockMask equal to `visible()` (built on the device, no host sync)."""
        key = ("block_mask", block_size)
        if key not in self._memo:
            self._memo[key] = tree_block_mask(self.ancestors, self.prefix_len, block_size)
        return self._memo[key]


def tree_block_mask(anc: torch.Tensor, prefix_len: int, block_size: int = FLEX_BLOCK):
    """BlockMask [1, 1, n, c + n] for rows seeing the prefix, themselves and their ancestors.

    Key blocks that lie wholly in the prefix are full (no mask_mod call in the kernel);
    blocks touching the tree are classified from the ancestor matrix into full, partial
    (mask_mod evaluated) or empty (skipped). Built from the block lists directly instead of
    evaluating mask_mod over the whole n x (c + n) grid.
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev = anc.device
    n, c, B = anc.shape[0], prefix_len, block_size
    L = c + n
    nqb, nkb = -(-n // B), -(-L // B)
    first = c // B  # key blocks [0, first) are prefix only
    ntail = nkb - first
    off = c - first * B  # prefix columns inside the first tail block
    vis = torch.zeros((nqb * B, ntail * B), dtype=torch.bool, device=dev)
    vis[:n, :off] = True
    vis[:n, off:off + n] = anc
    care = torch.zeros_like(vis)  # in range on both axes
    care[:n, : L - first * B] = True
    vis_b = vis.view(nqb, B, ntail, B)
    any_vis = vis_b.any(dim=3).any(dim=1)
    # A block is full when every in-range query row sees every key column and no key is out of range.
    cols_ok = care[0].view(ntail, B).all(dim=1)
    full_t = (vis_b | ~care.view(nqb, B, ntail, B)).all(dim=3).all(dim=1) & cols_ok[None, :]
    partial_t = any_vis & ~full_t
    full = torch.cat([torch.ones((nqb, first), dtype=torch.bool, device=dev), full_t], dim=1)
    partial = torch.cat([torch.zeros((nqb, first), dtype=torch.bool, device=dev), partial_t], dim=1)

    def lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(dim=1, dtype=torch.int32)
        order = torch.argsort(sel.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
        return num[None, None], order[None, None]

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    c_t = torch.tensor(c, device=dev)  # a captured tensor, not a Python int: no recompile per c
    last = n - 1

    def mask_mod(b, h, q_idx, kv_idx_):
        t = kv_idx_ - c_t
        inside = anc[q_idx.clamp(max=last), t.clamp(min=0, max=last)]
        return (t < 0) | (inside & (t <= last))

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(n, L), compute_q_blocks=False)


# ---- exact attention pieces (pure functions) -------------------------------------------------

def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, in float32, GQA by head grouping.

    q [b, hq, n, d]; k, v [b, hkv, m, d] (hq a multiple of hkv); mask: bool broadcastable to
    [n, m] (True = visible) or None. Returns out [b, hq, n, d] (q's dtype) and lse [b, hq, n]
    float32 (-inf for a row that sees nothing, whose out is 0).
    """
    b, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().view(b, hkv, g, n, d)
    scores = torch.matmul(qf, k.float()[:, :, None].transpose(-1, -2)) * scale  # [b, hkv, g, n, m]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    out = torch.matmul(p, v.float()[:, :, None])
    return out.view(b, hq, n, d).to(q.dtype), lse.view(b, hq, n)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the union of two disjoint key sets from the parts.

    out_*: [b, h, n, d] attention over each key set; lse_*: [b, h, n] their log-sum-exps
    (-inf for an empty set). Returns the union's (out [b, h, n, d] in out_a's dtype, lse).
    At least one of the two sets must be non-empty for every row.
    """
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    wa = torch.exp(lse_a.float() - lse)[..., None]
    wb = torch.exp(lse_b.float() - lse)[..., None]
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


PrefixFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def torch_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Pure-torch stand-in for flash-attn over the prefix (no mask): (out, lse), see `attention_lse`."""
    return attention_lse(q, k, v, scale)


def split_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TreeAttention, scale: float,
                         prefix_fn: PrefixFn = torch_prefix_attention) -> torch.Tensor:
    """Tree attention as prefix part + tree part merged by log-sum-exp.

    q [b, hq, n, d]; k, v [b, hkv, c + n, d] (the cache already holds the tree's keys).
    prefix_fn(q, k_prefix, v_prefix, scale) -> (out, lse) attends without a mask.
    Returns [b, hq, n, d].
    """
    c = tree.prefix_len
    out_t, lse_t = attention_lse(q, k[:, :, c:], v[:, :, c:], scale, tree.ancestors)
    if c == 0:
        return out_t
    out_p, lse_p = prefix_fn(q, k[:, :, :c], v[:, :, :c], scale)
    out, _ = merge_attention(out_p, lse_p, out_t, lse_t)
    return out


# ---- flash-attn ---------------------------------------------------------------------------------

def _flash_module():
    """The importable flash-attn entry point: FA3 (flash_attn_interface) first, then FA2; None if neither."""
    for name in ("flash_attn_interface", "flash_attn"):
        try:
            mod = importlib.import_module(name)
        except Exception:  # ImportError, or a CUDA build mismatch raising at import
            continue
        if hasattr(mod, "flash_attn_func"):
            return mod
    return None


def flash_available(device: torch.device | str) -> bool:
    """flash-attn is importable and the device is CUDA."""
    return torch.device(device).type == "cuda" and _flash_module() is not None


def flash_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """flash-attn over the prefix (every node sees all of it): (out [b, hq, n, d], lse [b, hq, n])."""
    mod = _flash_module()
    if mod is None:
        raise RuntimeError("flash-attn is not installed")
    res = mod.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=False, return_attn_probs=True)
    out, lse = res[0], res[1]
    return out.transpose(1, 2), lse.float()


# ---- the attention the engine's forward calls ------------------------------------------------

_FLEX_FNS: dict[tuple[bool, bool], Callable] = {}


def flex_compiled(device: torch.device | str) -> bool:
    """Whether flex runs compiled on `device`: CUDA yes, CPU no; BASTION_FLEX_COMPILE=0/1 overrides."""
    env = os.environ.get("BASTION_FLEX_COMPILE")
    if env in ("0", "1"):
        return env == "1"
    return torch.device(device).type == "cuda"


def _flex_fn(compiled: bool, cuda: bool) -> Callable:
    """flex_attention, eager or compiled. Compiled with dynamic shapes on CUDA (n and c change every
    step); static on CPU, where torch 2.13's C++ flex template fails to build with dynamic shapes
    (each new (n, c) then recompiles, so compiled flex on CPU is for tests only)."""
    key = (compiled, cuda)
    if key not in _FLEX_FNS:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX_FNS[key] = torch.compile(flex_attention, dynamic=cuda) if compiled else flex_attention
    return _FLEX_FNS[key]


def flex_attention_tree(query, key, value, tree: TreeAttention, scale: float | None,
                        compiled: bool | None = None) -> torch.Tensor:
    """FlexAttention over the tree's BlockMask: q [b, hq, n, d], k/v [b, hkv, c+n, d] -> [b, hq, n, d]."""
    compiled = flex_compiled(query.device) if compiled is None else compiled
    fn = _flex_fn(compiled, query.device.type == "cuda")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return fn(query, key, value, block_mask=tree.block_mask(), scale=scale,
                  enable_gqa=query.shape[1] != key.shape[1])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of s new tokens that follow m - s cached ones (no tree).

    q [b, hq, s, d]; k, v [b, hkv, m, d] (m >= s; the last s keys are the new tokens', hq a
    multiple of hkv). Returns [b, hq, s, d]. One token, or a first chunk without cache, needs
    no mask; a later chunk gets the lower-right causal mask.
    """
    s, m = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if s == 1 or m == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(s, m, q.device), scale=scale,
                                          enable_gqa=gqa)


def packed_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention with each key/value head's g = hq / hkv query heads stacked as rows.

    q [b, hq, s, d] (head h reads key/value head h // g, as SDPA's enable_gqa); k, v
    [b, hkv, m, d]; mask: bool [s, m] (or broadcastable [1, 1, s, m]) True where a row may
    attend, None for no mask. Returns [b, hq, s, d], the values of
    `F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)` up to summation order:
    one SDPA call over g s rows per key/value head instead of s rows per query head.
    Raises ValueError when hq is not a multiple of hkv.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} key/value heads")
    g = hq // hkv
    qp = q.reshape(b, hkv, g * n, d)  # rows of head h = j g + i sit at j, i n .. i n + n
    if mask is not None:
        mask = mask.reshape(n, -1).repeat(g, 1)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    return out.view(b, hq, n, d)


#: Query rows `choose_gqa_packing` considers: beyond a few rows the kernel is as fast either way.
GQA_PACK_MAX_ROWS = 8
#: Packing must beat the plain call by this factor at a row count to be chosen there.
GQA_PACK_MARGIN = 0.9


def choose_gqa_packing(dtype: torch.dtype, n_q: int, n_kv: int, head_dim: int, device: torch.device | str = "cpu",
                       context: int = 512, max_rows: int = GQA_PACK_MAX_ROWS, repeats: int = 60,
                       margin: float = GQA_PACK_MARGIN) -> frozenset[int]:
    """The query row counts s <= max_rows (1-node trees and one-token steps included) at which
    `packed_gqa_attention` beats SDPA with enable_gqa by `margin`, measured with random q, k,
    v over `context` cached tokens (the fastest of `repeats` calls each, interleaved).

    Empty off the CPU (the GPU path uses its own kernels), without grouped heads (n_q == n_kv)
    or when n_q is not a multiple of n_kv. Measured on a 2-core EPYC (no AMX): bfloat16 one
    row 290 us plain, 73 us packed (c = 512); float32 one row 42 us plain, 66 us packed, two
    and three rows 84 and 117 us plain, 78 and 91 us packed (docs/engine.md, "Few-row products").
    Takes about max_rows x repeats x 2 calls (well under a second).
    """
    if torch.device(device).type != "cpu" or n_q == n_kv or n_q % n_kv:
        return frozenset()
    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    best: dict[tuple[int, bool], float] = {}
    cases = []
    for s in range(1, max_rows + 1):
        # Row-major [s, hq, d] seen as [1, hq, s, d], as the forward hands it over.
        q = torch.randn(s, n_q, head_dim, generator=gen).to(dtype).transpose(0, 1)[None]
        k = torch.randn(1, n_kv, context + s, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, n_kv, context + s, head_dim, generator=gen).to(dtype)
        mask = torch.ones(s, context + s, dtype=torch.bool)
        cases.append((s, q, k, v, mask))
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first round warms up
            for s, q, k, v, mask in cases:
                for packed in (False, True):
                    t0 = time.perf_counter()
                    if packed:
                        packed_gqa_attention(q, k, v, scale, mask)
                    else:
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
                    dt = time.perf_counter() - t0
                    if rep:
                        best[(s, packed)] = min(best.get((s, packed), dt), dt)
    return frozenset(s for s in range(1, max_rows + 1) if best[(s, True)] < margin * best[(s, False)])


#: A decode batch's slots may span at most this many times its rows (slots between them run as
#: discarded rows): beyond it the padding would cost more than the per-row calls it replaces.
DECODE_SLOT_SPAN = 2


class DecodeBatch:
    """Attention of several one-token rows, each over its own KV slot, as one padded SDPA call
    per layer instead of one call per row (docs/engine.md, "One attention call for decode rows").

    Every row of a batched plain step attends only to its own slot's cached keys and its own new
    key. Per-row calls pay a dispatch and a thread-team start each and give two threads three
    key/value heads of work; one call over the slots' range, padded to the longest row and
    masked, measured 1.3-1.8x faster per layer from 2 rows up (2-core EPYC, avx2, float32).
    The padding changes the kernel's summation order, so a row's output agrees with the
    per-row call to rounding (about 1e-7 relative in float32), as a tree's rows already do.

    The rows' slots must lie within a range of at most DECODE_SLOT_SPAN x rows slots; slots in
    the range that hold no row are computed as throw-away rows that see key 0 only. Keys past a
    row's length are read and masked: a slot position holds an earlier occupant's finite values
    or zeros (engine.kv_cache), never a NaN that a mask could not hide.

    slots: the rows' KV slots (distinct); lengths: keys each row attends to (its cached tokens
    plus its own); rows: the rows' indices in the forward's token order. Build with `plan`.
    """

    __slots__ = ("lo", "hi", "length", "q_rows", "pick", "mask")

    def __init__(self, slots: list[int], lengths: list[int], rows: list[int], device: torch.device | str):
        self.lo, self.hi = min(slots), max(slots) + 1
        self.length = max(lengths)
        span = self.hi - self.lo
        q_rows = [rows[0]] * span  # throw-away rows reuse a real row's query
        seen = [1] * span  # a throw-away row sees key 0 only (an all-masked row would give NaN)
        for slot, n, row in zip(slots, lengths, rows):
            q_rows[slot - self.lo] = row
            seen[slot - self.lo] = n
        self.q_rows = torch.tensor(q_rows, device=device)
        self.pick = torch.tensor([slot - self.lo for slot in slots], device=device)
        # [span, 1, 1, length] bool: row r sees keys 0 .. seen[r] - 1
        self.mask = (torch.arange(self.length, device=device)[None, :]
                     < torch.tensor(seen, device=device)[:, None])[:, None, None, :]

    @classmethod
    def plan(cls, slots: list[int], lengths: list[int], rows: list[int],
             device: torch.device | str) -> "DecodeBatch | None":
        """A DecodeBatch for these rows, or None when one call would not pay: fewer than two
        rows, or slots spread over more than DECODE_SLOT_SPAN x rows slots.
        Raises ValueError when slots repeat or the lists differ in length."""
        if not len(slots) == len(lengths) == len(rows):
            raise ValueError("slots, lengths and rows must have one entry per row")
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode rows share a slot: {slots}")
        if len(slots) < 2 or max(slots) - min(slots) + 1 > DECODE_SLOT_SPAN * len(slots):
            return None
        return cls(slots, lengths, rows, device)

    @property
    def rows(self) -> int:
        """Rows this batch computes (the throw-away rows not counted)."""
        return int(self.pick.shape[0])

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """q [N, hq, d]: every row of the forward (after rotary); keys, values [slots, hkv, C, d]:
        one layer of the pool, the rows' new keys already written. Returns [rows, hq * d], the
        attention output of each row in the order of `slots` (hq a multiple of hkv: query heads
        stacked per key/value head, as packed_gqa_attention)."""
        hq, d = q.shape[1], q.shape[2]
        hkv = keys.shape[1]
        span = self.hi - self.lo
        qp = q[self.q_rows].view(span, hkv, hq // hkv, d)
        out = F.scaled_dot_product_attention(qp, keys[self.lo:self.hi, :, :self.length],
                                             values[self.lo:self.hi, :, :self.length],
                                             attn_mask=self.mask, scale=scale)
        return out.reshape(span, hq * d)[self.pick]


def causal_mask(s: int, m: int, device: torch.device | str) -> torch.Tensor:
    """bool [s, m]: row i of s new tokens after m - s cached ones sees keys 0..m - s + i."""
    return torch.ones((s, m), dtype=torch.bool, device=device).tril(diagonal=m - s)


def tree_attention(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tree: TreeAttention,
                   scale: float) -> torch.Tensor:
    """Attention of a tree's n nodes over its c = tree.prefix_len cached tokens and the nodes.

    backend: a public name (BACKENDS); q [b, hq, n, d]; k, v [b, hkv, c + n, d] (the tree's
    keys already written behind the prefix). Returns [b, hq, n, d]. Raises ValueError for an
    unknown backend.
    """
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=tree.visible(), scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if backend == "flex":
        return flex_attention_tree(q, k, v, tree, scale)
    if backend == "flash_attn":
        return split_tree_attention(q, k, v, tree, scale, flash_prefix_attention)
    raise ValueError(f"unknown attention backend '{backend}' (choose from {', '.join(BACKENDS)})")


# ---- selection ----------------------------------------------------------------------------------

def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on `device`: sdpa and flex everywhere, flash_attn on CUDA when installed."""
    out = ["sdpa", "flex"]
    if flash_available(device):
        out.append("flash_attn")
    return out


def random_tree_parents(n: int, max_depth: int = 15, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n] int64 parents of a random prefix-closed tree (node 0 the root, depth <= max_depth)."""
    par = [-1]
    depth = [0]
    for i in range(1, n):
        while True:
            p = int(torch.randint(0, i, (1,), generator=generator))
            if depth[p] < max_depth:
                break
        par.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(par, dtype=torch.long)


def benchmark_backends(device: torch.device | str, dtype: torch.dtype = torch.float32, *, n_q: int = 32, n_kv: int = 8,
                       head_dim: int = 128, points: tuple[tuple[int, int], ...] | None = None, repeats: int = 3,
                       backends: list[str] | None = None, atol: float | None = None) -> dict[str, float | None]:
    """Seconds per attention call (summed over `points` of (n tree nodes, c prefix)) per backend.

    Each backend's output is first compared with sdpa's; one that disagrees beyond atol
    (default 2e-2 in 16-bit, 1e-4 in float32) or fails gets None. Default points: (32, 256)
    on CPU, (64, 1024) and (256, 2048) elsewhere.
    """
    device = torch.device(device)
    points = points or (((32, 256),) if device.type == "cpu" else ((64, 1024), (256, 2048)))
    backends = backends or available_backends(device)
    atol = atol if atol is not None else (1e-4 if dtype == torch.float32 else 2e-2)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n, c in points:
        q = torch.randn(1, n_q, n, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(1, n_kv, c + n, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(1, n_kv, c + n, head_dim, generator=gen).to(device, dtype)
        cases.append((q, k, v, random_tree_parents(n, generator=gen), c))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(name: str, case) -> torch.Tensor:
        q, k, v, par, c = case
        tree = TreeAttention.from_parents(par, c, device, 15)
        return tree_attention(name, q, k, v, tree, head_dim ** -0.5)

    refs = [run("sdpa", case) for case in cases]
    out: dict[str, float | None] = {}
    for name in backends:
        try:
            for case, ref in zip(cases, refs):
                got = run(name, case)  # also the warm-up (compilation for flex on CUDA)
                if not torch.allclose(got.float(), ref.float(), atol=atol, rtol=0):
                    raise ValueError("disagrees with sdpa")
            total = 0.0
            for case in cases:
                times = []
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    run(name, case)
                    sync()
                    times.append(time.perf_counter() - t0)
                total += min(times)
            out[name] = total
        except Exception:  # a backend that cannot run here is simply not selected
            out[name] = None
    return out


_SELECTED: dict[tuple, str] = {}


def select_backend(name: str = "auto", device: torch.device | str = "cpu", *, config=None,
                   dtype: torch.dtype = torch.float32) -> str:
    """The backend to verify with: `name` itself (checked), or for 'auto' the fastest measured one
    (on a CPU 'auto' is sdpa without measuring: the CPU default).

    config: the target's HF config (its head counts and head_dim shape the measurement).
    The choice for 'auto' is remembered per (device, dtype, shape) for the process.
    Raises ValueError for an unknown name or one not available on the device.
    """
    device = torch.device(device)
    if name == "auto" and device.type == "cpu":
        # On a CPU, flex runs an unfused reference (or recompiles per shape) and flash-attn is absent.
        return "sdpa"
    if name != "auto":
        check_backend(name)
        if name not in available_backends(device):
            raise ValueError(f"attention backend '{name}' is not available on {device} "
                             f"(available: {', '.join(available_backends(device))})")
        return name
    n_q = int(getattr(config, "num_attention_heads", 32))
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_q)
    hd = int(getattr(config, "head_dim", None) or getattr(config, "hidden_size", 128 * n_q) // n_q)
    key = (str(device), str(dtype), n_q, n_kv, hd)
    if key not in _SELECTED:
        times = benchmark_backends(device, dtype, n_q=n_q, n_kv=n_kv, head_dim=hd)
        ok = {k: v for k, v in times.items() if v is not None}
        _SELECTED[key] = min(ok, key=lambda k: (ok[k], BACKENDS.index(k))) if ok else "sdpa"
    return _SELECTED[key]
