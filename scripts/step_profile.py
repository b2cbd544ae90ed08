"""Where one forward of R one-token rows goes (the shipped target, float32, 2 threads): the step's
median time, the profiler's self time split into the linears, attention and everything else (the
small element-wise ops and their dispatch), and two ablations that bound what the element-wise part
costs in place: RMSNorm replaced by its weight alone, rotary replaced by nothing (wrong values,
right shapes). Then the body's linears alone at M rows (prefill chunk sizes), prepacked, in GFLOP/s.
Figures in docs/engine.md, "Where a step's time goes". Usage: python scripts/step_profile.py [CONTEXT]"""
import statistics, sys, time
import torch
from torch.profiler import ProfilerActivity, profile
from bastion.factory import build_engine
from bastion.settings import EngineSettings
from engine.forward import Segment, TargetForward, target_forward_for

torch.set_num_threads(2)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 300
eng = build_engine(EngineSettings(mode="ar", dtype="float32", threads=2), max_batch=8)
fwd = target_forward_for(eng.target.model)
pool = fwd.new_pool(8, 1024)
g = torch.Generator().manual_seed(0)
for s in range(8):
    pool.allocate()
    fwd(pool, torch.randint(0, 40000, (ctx,), generator=g), torch.arange(ctx), [Segment(s, 0, ctx)], last_only=True)


def rows_args(rows):
    return (pool, torch.randint(0, 40000, (rows,), generator=g), torch.full((rows,), ctx),
            [Segment(s, ctx, 1) for s in range(rows)])


def step_ms(rows, n=11):
    args = rows_args(rows)
    for _ in range(2):
        fwd(*args, last_only=True)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fwd(*args, last_only=True)
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


for rows in (1, 8):
    args = rows_args(rows)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5):
            fwd(*args, last_only=True)
    parts = {"linears": 0.0, "attention": 0.0, "other": 0.0}
    events = 0
    for ev in p.key_averages():
        key = ("linears" if "linear" in ev.key or "addmm" in ev.key
               else "attention" if "scaled_dot_product" in ev.key else "other")
        parts[key] += ev.self_cpu_time_total / 5e3
        events += ev.count / 5
    print(f"{rows} rows, context {ctx}: step {step_ms(rows):.1f} ms; profiled "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()) + f"; {events:.0f} profiler events a step", flush=True)

rms, rope = TargetForward.__dict__["_rms"], TargetForward.__dict__["_rope"]
variants = {"as shipped": (rms, rope), "RMSNorm -> x * w": (lambda self, x, w: x * w, rope),
            "rotary -> identity": (rms, staticmethod(lambda x, cos, sin: x))}
times = {name: {1: [], 8: []} for name in variants}
try:
    for _ in range(3):  # interleaved rounds: the VM drifts
        for name, (r, ro) in variants.items():
            TargetForward._rms, TargetForward._rope = r, ro
            for rows in (1, 8):
                times[name][rows].append(step_ms(rows))
finally:
    TargetForward._rms, TargetForward._rope = rms, rope
for name, t in times.items():
    print(f"{name:20s} 1 row {statistics.median(t[1]):.1f} ms, 8 rows {statistics.median(t[8]):.1f} ms")

layer = fwd.layers[0]
lins = [lin for lay in fwd.layers for lin in (lay.qkv, lay.o, lay.gate_up, lay.down)]
flops_per_row = 2 * sum(lin.out_features * lin.in_features for lin in lins)
for m in (1, 8, 64, 256):
    xs = {lin.in_features: torch.randn(m, lin.in_features) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)}
    ts = []
    for _ in range(4):
        t0 = time.perf_counter()
        for lin in lins:
            lin(xs[lin.in_features])
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts[1:])
    print(f"body linears at M = {m}: {1e3 * t:.1f} ms, {flops_per_row * m / t / 1e9:.0f} GFLOP/s, {1e3 * t / m:.2f} ms a row")
