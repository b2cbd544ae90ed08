"""Linear layers of the target's forward, with the weight prepacked once where that pays.

On a CPU, `F.linear` hands every call to MKL's sgemm, which for the few rows of a decode or
verification step (M = 1..256) re-packs the weight on every call and streams it at a
fraction of the memory bandwidth. oneDNN can pack a weight once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and multiply from it (`_linear_pointwise`), the
path inductor's freezing pass takes. Whether it is faster depends on the CPU and dtype, so
`choose_packing` measures both over the model's own weight shapes and keeps the faster one
(docs/engine.md has the figures). On other devices the weight stays as it is.
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
