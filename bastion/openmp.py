"""OpenMP wait policy and oneDNN kernel cache for the engine's CPU kernels, set before torch loads.

The decoding step is hundreds of small parallel regions (one per GEMM, norm and attention call,
tens of microseconds each), separated by a little Python. PyTorch's CPU wheels use GNU libgomp,
whose idle workers, once the process holds more OpenMP threads than CPUs, spin only about 1,000
times before sleeping; every region then pays a futex wake-up. That happens as soon as two threads
have run parallel regions, for example a model loaded in the main thread and decoded by a
scheduler's worker thread (the concurrency benchmark; the server builds its engine in the worker
thread itself). OMP_WAIT_POLICY=ACTIVE with a finite GOMP_SPINCOUNT lets workers spin that many
times, then sleep; ACTIVE alone spins forever, so an idle team never yields its core (measured
slower than the default). Measured on a 2-core AMD EPYC (avx512_bf16, no AMX), float32, 2 threads,
nothing else running (docs/engine.md, "Threads"): an [8, 576] x [576, 1536] GEMM in a second
thread after the main thread had run one took 289 us by default and 159 us with these settings;
a batched decoding step of 8 sequences in such a thread, median of 25, three interleaved rounds:
82 / 66 / 54 ms by default, 62 / 58 / 48 at 200,000 spins, 44 / 64 / 39 at 2,000,000 and
45 / 56 / 34 at 20,000,000 (the same step in the main thread: 29-53 ms; this VM is noisy).

ONEDNN_PRIMITIVE_CACHE_CAPACITY: oneDNN compiles a kernel per (weight shape, dtype, rows) and
keeps 1,024 by default. A target's four linear shapes at every tree size up to 256 already fill
that, and the drafter's and the LM head's shapes come on top: with the default, a second pass
over 4 shapes x 256 row counts took 1.30 s in bfloat16 (kernels rebuilt) against 0.26 s at
4,096 (same 2-core EPYC). 16,384 kernels cost a few MB (engine.linear.warm_up fills the cache).
"""
from __future__ import annotations

import os
import sys

#: Environment defaults applied by `apply_defaults` (a user's own values win).
DEFAULTS = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000000", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16384"}


def apply_defaults(environ: dict | None = None) -> bool:
    """Set DEFAULTS in `environ` (default os.environ) where unset. Returns False, changing nothing,
    when torch is already imported (its OpenMP runtime read the environment at load)."""
    if "torch" in sys.modules:
        return False
    env = os.environ if environ is None else environ
    for key, value in DEFAULTS.items():
        env.setdefault(key, value)
    return True
