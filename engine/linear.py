"""Linear layers of the target's forward, with the weight prepacked once where that pays.

On a CPU, `F.linear` hands every call to MKL's sgemm, which for the few rows of a decode or
verification step (M = 1..256) re-packs the weight on every call and streams it at a
fraction of the memory bandwidth. oneDNN can pack a weight once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and multiply from it (`_linear_pointwise`), the
path inductor's freezing pass takes. Whether it is faster depends on the CPU and dtype, so
`choose_packing` measures both over the model's own weight shapes and keeps the faster one
(docs/engine.md has the figures). On other devices the weight stays as it is.

oneDNN's packed kernels are also not monotone in the row count: on a 2-core EPYC (no AMX) in
float32 one row cost 18-25 % more than four or five over the model's whole stack. `choose_row_padding`
measures that once per model and `Linear` then runs a few-row product on zero-padded rows
where that is faster (docs/engine.md, "Few-row products").
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def mkldnn_packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packed linears can run here (CPU, oneDNN built in, a dtype it packs)."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16)
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x W^T (+ b) for x [M, in] -> [M, out].

    weight: [out, in]; bias: [out] or None; packed: use oneDNN's prepacked weight (CPU only;
    the plain weight is then not kept). The result's values may differ from `F.linear` in
    the last bits (a different summation order), never in shape or dtype.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: bool = False):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if packed else weight
        #: {M: M'}: a 2-D input of M rows runs as M' > M rows, the extra ones zero (`choose_row_padding`).
        self.row_padding: dict[int, int] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        pad = self.row_padding.get(x.shape[0]) if self.row_padding and x.dim() == 2 else None
        if pad is not None:
            # Rows are independent: the padded rows' outputs are dropped, the real rows' kept.
            m = x.shape[0]
            return self._product(F.pad(x, (0, 0, 0, pad - m)))[:m]
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _time_stack(weights: list[torch.Tensor], packed: bool, rows: tuple[int, ...], repeats: int) -> float:
    """Median seconds of one pass of x [M, in] through every weight, summed over `rows`."""
    layers = [Linear(w, None, packed) for w in weights]
    total = 0.0
    for m in rows:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights}
        times = []
        for _ in range(repeats + 1):  # the first pass warms up
            t0 = time.perf_counter()
            for lin in layers:
                lin(xs[lin.in_features])
            times.append(time.perf_counter() - t0)
        times = sorted(times[1:])
        total += times[len(times) // 2]
    return total


def choose_packing(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 16), repeats: int = 3) -> bool:
    """Whether prepacked oneDNN linears beat `F.linear` over `weights` ([out, in] each, the
    model's decoder weights, read cold as in a real forward) at the given row counts.

    False when packing is unavailable here or fails. Takes about (plain + packed) x
    len(rows) x (repeats + 1) passes over the weights (well under a second for a 135M model).
    """
    if not weights or not mkldnn_packing_available(weights[0].dtype, weights[0].device):
        return False
    try:
        packed = _time_stack(weights, True, rows, repeats)
    except RuntimeError:  # oneDNN refused this dtype or shape on this CPU
        return False
    plain = _time_stack(weights, False, rows, repeats)
    return packed < plain


#: Row counts `choose_row_padding` considers, as inputs and as padded sizes: the steps of one
#: sequence (a plain step, a small tree, a drafter's few-row catch-up) live here.
PAD_MAX_ROWS = 8
#: A padded size must beat the row count's own time by this factor. At 0.95 a float32 plan padded
#: three and four rows to five, and the full verification gained nothing (31.4 vs 31.7 ms).
PAD_MARGIN = 0.92


def choose_row_padding(linears: list[Linear], max_rows: int = PAD_MAX_ROWS, repeats: int = 7,
                       margin: float = PAD_MARGIN) -> dict[int, int]:
    """{M: M'} for the row counts M <= max_rows whose product over `linears` (the model's own,
    in forward order, read cold as in a real forward) runs faster as M' > M rows, M' <= max_rows:
    the M' of least measured time, kept only when it is below `margin` times M's own.

    Each row count 1..max_rows is timed over the whole stack `repeats` times, interleaved with
    the others, and the fastest round kept. Measured on a 2-core EPYC (no AMX), float32 packed: one
    row 22.9 ms, five rows 18.9 ms over the 121 linears of SmolLM2-135M; the full one-token
    verification went from 32.3 to 28.7 ms padded to four rows (docs/engine.md, "Few-row
    products"). Empty (no padding) for an empty list or linears off the CPU. Takes
    max_rows x repeats passes over the stack (about a second for a 135M model).
    """
    if not linears or linears[0].weight.device.type != "cpu":
        return {}
    rows = range(1, max_rows + 1)
    dtype = linears[0].weight.dtype  # a packed weight keeps its dtype
    xs = {m: {n: torch.randn(m, n, dtype=dtype) for n in {lin.in_features for lin in linears}} for m in rows}
    times: dict[int, list[float]] = {m: [] for m in rows}
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first round warms up
            for m in rows:
                t0 = time.perf_counter()
                for lin in linears:
                    lin._product(xs[m][lin.in_features])
                if rep:
                    times[m].append(time.perf_counter() - t0)
    # The fastest round: interference on a shared machine only ever adds time.
    best_t = {m: min(t) for m, t in times.items()}
    plan = {}
    for m in rows:
        best = min(range(m, max_rows + 1), key=lambda k: best_t[k])
        if best > m and best_t[best] < margin * best_t[m]:
            plan[m] = best
    return plan


#: (in, out, dtype, packed) of the linears `warm_up` has swept in this process: oneDNN's kernel
#: cache is the process's, so a second engine over the same shapes has nothing to build.
_WARMED: set[tuple] = set()

#: Row counts `warm_up` covers by default: every tree size the CPU policy may verify
#: (controller.policy.CPU_SETTINGS.max_nodes).
WARM_ROWS = 256


def warm_up(linears, max_rows: int = WARM_ROWS, stop_s: float = 0.01) -> int:
    """Run each distinct oneDNN linear once at every row count 1..max_rows, so that no decoding
    step pays for building a kernel.

    oneDNN builds (JIT-compiles) a kernel the first time it sees a (weight shape, dtype, M)
    and caches it: on a 2-core AMD EPYC (no AMX) a first call took 0.8-1 ms in bfloat16 and
    1.3-8 ms in float32 against 0.07-0.15 ms after, so every tree size a step verified for the
    first time cost ~18 ms more (docs/controller.md, "The cost of the controller itself").
    Fixed trees pay that once; an adaptive tree, a drafter's catch-up over a varying number of
    context rows and a batch's summed trees keep meeting new sizes. The kernel cache must hold
    them all (bastion/openmp.py raises its capacity).

    linears: `Linear`s or `torch.nn.Linear`s (others are skipped); only those oneDNN runs are
    warmed (packed ones, and any on a CPU in a dtype other than float32, which MKL runs
    without compiling). Duplicates by (in, out, dtype, packing) run once per process. A linear's sweep stops
    at the first call slower than stop_s seconds: there the product itself dwarfs a compile
    (the 49k-row LM head). Returns the number of calls made (0 off the CPU).
    """
    calls = 0
    with torch.inference_mode():
        for lin in linears:
            weight = lin.weight
            packed = bool(getattr(lin, "packed", False))
            if not hasattr(lin, "in_features") or weight.device.type != "cpu" or \
                    (not packed and weight.dtype == torch.float32):
                continue
            dtype = weight.dtype  # a packed weight keeps its dtype
            key = (lin.in_features, lin.out_features, dtype, packed)
            if key in _WARMED:
                continue
            _WARMED.add(key)
            for m in range(1, max_rows + 1):
                x = torch.zeros(m, lin.in_features, dtype=dtype)
                t0 = time.perf_counter()
                lin(x)
                calls += 1
                if time.perf_counter() - t0 > stop_s:
                    break
    return calls

