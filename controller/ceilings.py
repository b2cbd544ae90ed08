"""Device ceilings: measured matmul throughput and memory bandwidth, plus a datasheet cross-check.

The roofline's `P` (FLOP/s) and `BW` (bytes/s) come from short microbenchmarks on the
device the server actually runs on, so a CPU or an unknown GPU needs no table. The
datasheet table is only shown next to the measurement in the calibration report.
"""
from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass

import torch

#: Dense datasheet peaks (FLOP/s for 16-bit tensor-core matmul, bytes/s HBM/GDDR),
#: from the vendors' product pages. Matched by substring of the device name,
#: longest key first, so "H100 PCIe" wins over "H100".
DATASHEET: dict[str, tuple[float, float]] = {
    "A100": (312e12, 1.935e12),
    "H100 PCIe": (756e12, 2.0e12),
    "H100": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "B200": (2250e12, 8.0e12),
    "L40S": (362e12, 0.864e12),
    "L4": (121e12, 0.3e12),
    "A10": (125e12, 0.6e12),
    "V100": (125e12, 0.9e12),
    "T4": (65e12, 0.32e12),
}


@dataclass(frozen=True)
class Ceilings:
    """Compute and memory ceilings of one device.

    flops_per_s: matmul throughput (FLOP/s) in the model's dtype.
    bytes_per_s: memory bandwidth (bytes/s, read + write traffic of a large copy).
    device: device name (see `device_name`). source: 'measured', 'datasheet' or 'given'.
    """

    flops_per_s: float
    bytes_per_s: float
    device: str
    source: str = "measured"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ceilings":
        """Inverse of `to_dict`; raises KeyError/TypeError on a malformed dict."""
        return cls(float(d["flops_per_s"]), float(d["bytes_per_s"]), str(d["device"]), str(d.get("source", "given")))


#: CPU flags that change how fast a target forward runs (bfloat16 matrix units, vector widths).
CPU_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")


def cpu_identity() -> tuple[str, tuple[str, ...], int]:
    """(model name, the CPU_FLAGS present, logical cores) from /proc/cpuinfo and os.cpu_count().

    Two machines that report the same model name ("Intel(R) Xeon(R) Processor") may differ in
    AMX, and a bfloat16 forward then costs several times more on one than the other.
    """
    import os

    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                low = line.lower()
                if not name and low.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif not flags and low.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "cpu"
    return name, tuple(f for f in CPU_FLAGS if f in flags), os.cpu_count() or 1


def device_name(device: torch.device | str = "cpu") -> str:
    """Device identity for reports and calibration caches: the CUDA device name, or for a CPU its
    model string, the speed-relevant flags it has (CPU_FLAGS), its logical cores and the torch
    threads in use (each changes the ceilings), e.g. "Intel(R) Xeon(R) [amx_bf16 avx2] (2 cores, 2 threads)".
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name, flags, cores = cpu_identity()
    flag_text = f" [{' '.join(flags)}]" if flags else ""
    return f"{name}{flag_text} ({cores} cores, {torch.get_num_threads()} threads)"


def datasheet_ceilings(name: str) -> Ceilings | None:
    """Datasheet ceilings for a device name (substring match, longest key first); None if unknown."""
    for key in sorted(DATASHEET, key=len, reverse=True):
        if key.lower() in name.lower():
            flops, bw = DATASHEET[key]
            return Ceilings(flops, bw, name, "datasheet")
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(fn, work: float, device: torch.device, budget_s: float, min_reps: int = 3) -> float:
    """Run fn (one warm-up, then until budget_s or min_reps) and return work / fastest run."""
    fn()
    _sync(device)
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        reps += 1
        if reps >= 50:
            break
    return work / best


def measure_matmul_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         n: int | None = None, budget_s: float = 0.6) -> float:
    """Matmul throughput in FLOP/s: best of repeated n x n @ n x n products (2*n^3 FLOPs each).

    n: matrix side; default 1024 on CPU, 8192 on CUDA. budget_s: seconds spent timing
    (at least 3 runs). float16 on CPU is measured in float32 (no fast CPU kernel).
    """
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _best_rate(lambda: torch.matmul(a, b, out=out), 2.0 * n**3, device, budget_s)


def measure_bandwidth(device: torch.device | str = "cpu", nbytes: int | None = None, budget_s: float = 0.6) -> float:
    """Memory bandwidth in bytes/s: best of repeated copies of an nbytes buffer (2*nbytes moved each).

    nbytes: buffer size; default 128 MiB on CPU (beyond the last-level cache), 1 GiB on CUDA.
    """
    device = torch.device(device)
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (128 << 20))
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4, device, budget_s)


def measure_ceilings(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     budget_s: float = 1.2) -> Ceilings:
    """Measure both ceilings on `device` in about budget_s seconds (CPU: under 3 s in all).

    Returns Ceilings(source='measured'); compare with `datasheet_ceilings(device_name(device))`.
    """
    device = torch.device(device)
    flops = measure_matmul_flops(device, dtype, budget_s=budget_s / 2)
    bw = measure_bandwidth(device, budget_s=budget_s / 2)
    return Ceilings(flops, bw, device_name(device), "measured")
