"""How well the adaptive controller's latency model follows the machine, step by step.

Builds the bastion engine with a fresh calibration (with --busy, beside a one-thread matmul
loop that is stopped when the calibration is done, as scripts/bench_busy_calibration.sh does),
serves the prompts one after another with the controller's state kept across them, and records
every verification: tree size s, context c, measured and predicted seconds. Prints the MAPE of
each `--window` steps and the median plain step (the machine's own speed), then replays the
same measured steps through fresh profilers started from the same calibration with level
tracking on and off (the decisions of the live run are kept; only the model's error differs).
Writes a compact JSON with the per-window figures and the per-step trace to --out.
Usage: python scripts/latency_trace.py DTYPE [--busy] [--sets mt-bench:4,humaneval:4,math:4]
       [--tokens 128] [--window 64] [--out FILE]
"""
import argparse, json, os, statistics, subprocess, sys, tempfile, time

import numpy as np
import torch

ap = argparse.ArgumentParser()
ap.add_argument("dtype")
ap.add_argument("--busy", action="store_true", help="calibrate beside a second CPU-heavy process")
ap.add_argument("--sets", default="mt-bench:4,humaneval:4,math:4")
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--window", type=int, default=64)
ap.add_argument("--out", default="")
args = ap.parse_args()
os.environ["BASTION_CACHE"] = tempfile.mkdtemp()  # a fresh calibration, never a cached one

from bastion.factory import build_engine  # noqa: E402  (after BASTION_CACHE is set)
from bastion.settings import EngineSettings  # noqa: E402
from bench.datasets import load_dataset  # noqa: E402
from controller.latency_model import mape  # noqa: E402
from controller.profiler import OnlineProfiler  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

torch.set_num_threads(2)
busy = None
if args.busy:
    loop = ("import numpy as np\na = np.random.rand(700, 700)\n"
            "while True:\n    a = a @ a; a /= np.abs(a).max()\n")
    busy = subprocess.Popen([sys.executable, "-c", loop], env={**os.environ, "OMP_NUM_THREADS": "1",
                                                               "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
try:
    eng = build_engine(EngineSettings(mode="bastion", dtype=args.dtype, threads=2))
finally:
    if busy is not None:
        busy.kill()
        busy.wait()
prof = eng.controller.profiler
prompts = []
for spec in args.sets.split(","):
    name, _, n = spec.partition(":")
    prompts += [eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}]) for p in load_dataset(name, int(n or 2))]

steps = []  # (s, c, measured_s, predicted_s, refits, rescales)
t0 = time.perf_counter()
for ids in prompts:
    seq = eng.start(ids, SamplingParams(max_tokens=args.tokens))
    while seq.finish_reason is None:
        last = prof.records[-1] if prof.records else None
        eng.step(seq)
        if prof.records and prof.records[-1] is not last:  # a new StepRecord object: this step's
            r = prof.records[-1]
            steps.append((r.s, r.c, r.verify_s, r.predicted_s, prof.refits, prof.rescales))
    eng.release(seq)
wall = time.perf_counter() - t0


def windows(meas, pred):
    w = args.window
    return [round(float(mape(meas[i:i + w], pred[i:i + w])), 3) for i in range(0, len(meas) - w + 1, w)]


s = np.array([x[0] for x in steps])
c = np.array([x[1] for x in steps])
meas = np.array([x[2] for x in steps])
live = windows(meas, np.array([x[3] for x in steps]))
plain = [round(1e3 * statistics.median(meas[i:i + args.window][s[i:i + args.window] == 1]), 1)
         if (s[i:i + args.window] == 1).any() else None for i in range(0, len(meas) - args.window + 1, args.window)]
replay = {}
for name, lw in (("level tracking", None), ("refits only", 0)):
    kw = {} if lw is None else {"level_window": lw}
    p = OnlineProfiler(prof.calibrated, prof.calibration_points, history=prof.records.maxlen, window=prof.window,
                       threshold=prof.threshold, bias_threshold=prof.bias_threshold, **kw)
    preds = []
    for si, ci, m in zip(s, c, meas):
        pr = float(p.model.predict(np.array([si]), np.array([ci]))[0])
        preds.append(pr)
        p.record(int(si), int(ci), float(m), pr, 0.0, 0.0, False)
    preds = np.array(preds)
    w = args.window
    replay[name] = {"windows": windows(meas, preds), "after_first_window": round(float(mape(meas[w:], preds[w:])), 3),
                    "refits": p.refits, "rescales": p.rescales}
res = {"dtype": args.dtype, "busy_calibration": args.busy, "steps": len(steps), "wall_s": round(wall, 1),
       "window": args.window, "live": {"windows": live, "refits": prof.refits, "rescales": prof.rescales,
                                       "after_first_window": round(float(mape(meas[args.window:],
                                                                              np.array([x[3] for x in steps])[args.window:])), 3)},
       "median_plain_ms": plain, "replay": replay,
       "mean_tree": round(float(s.mean()), 2)}
res["trace"] = {"s": s.tolist(), "c": c.tolist(), "measured_ms": [round(1e3 * x, 2) for x in meas],
                "predicted_ms": [round(1e3 * x[3], 2) for x in steps]}
snap = eng.controller.snapshot()
res["controller"] = {k: snap.get(k) for k in ("steps", "gate")}
print(json.dumps(res, indent=1, default=str))
if args.out:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
