"""A saved busy calibration replayed on a quiet machine: does the controller repair its shape?

Loads the target and drafter, builds adaptive controllers from the calibration stored in a
`bastion bench` results.json (`environment.calibration`, for example a matrix's busy run), primes
their gates beside a one-thread matmul loop (as a busy start-up does), stops the loop, then serves
the prompts with every variant, tree-8 and AR interleaved per prompt (128 tokens each, the
controllers' state kept across prompts). Variants: "steps" (the shipped rule: a refit leaves out
the calibration points at sizes the steps have measured, controller.profiler.anchor_points) and
"kept" (every calibration point kept in refits, the rule before it). Prints per prompt tokens/s,
tau, mean tree size, refits and the online error, then tokens/s per dataset over AR.
Usage: python scripts/busy_calibration_replay.py DTYPE RESULTS_JSON [DATASET:N ...]
"""
import collections
import json
import math
import subprocess
import sys

import numpy as np
import torch

from bastion.factory import build_engine, prime_gate
from bastion.settings import EngineSettings
from bench.datasets import load_dataset
from controller.budget import BudgetController
from controller.calibration import CalibrationResult
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

torch.set_num_threads(2)
dtype, src = sys.argv[1], sys.argv[2]
sets = sys.argv[3:] or ["mt-bench:3", "humaneval:2"]
eng = build_engine(EngineSettings(mode="bastion", dtype=dtype, threads=2))
res = CalibrationResult.from_json(json.load(open(src))["environment"]["calibration"])
p = res.model().predict(np.array([1, 2, 4, 8, 16, 32]), np.array([256] * 6))
print("replayed calibration: spread %.2f, C(s) / C(1) at s = 1..32: %s" % (res.spread, " ".join("%.2f" % x for x in p / p[0])))


def controller(variant):
    c = BudgetController.from_calibration(res, device="cpu", max_depth=eng.drafter.max_depth, surrogate_correction=True)
    c.calibration = res
    if variant == "kept":
        c.profiler.measured_knot = math.inf
    return c


loop = "import numpy as np\na = np.random.rand(700, 700)\nwhile True:\n    a = a @ a; a /= np.abs(a).max()\n"
busy = subprocess.Popen([sys.executable, "-c", loop], env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                                           "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin"})
variants = ("steps", "kept")
try:
    engines = {}
    for v in variants:
        engines[v] = Engine(eng.target, eng.drafter, controller(v), backend=eng.backend)
        prime_gate(engines[v])
finally:
    busy.kill()
    busy.wait()
engines["tree-8"] = Engine(eng.target, eng.drafter, make_controller("tree", 8), backend=eng.backend)
engines["ar"] = Engine(eng.target, None, make_controller("ar"), backend=eng.backend)
prompts = []
for spec in sets:
    name, _, n = spec.partition(":")
    prompts += [(name, eng.chat_prompt_ids([{"role": "user", "content": q["prompt"]}])) for q in load_dataset(name, int(n))]
names = list(engines)
total = collections.defaultdict(lambda: [0, 0.0])
for i, (ds, ids) in enumerate(prompts):
    k = i % len(names)
    row = {}
    for name in names[k:] + names[:k]:
        e = engines[name]
        seq = e.start(ids, SamplingParams(max_tokens=128))
        steps = acc = nodes = 0
        t = 0.0
        while seq.finish_reason is None:
            st = e.step(seq).step
            steps += 1
            acc += st.accepted
            nodes += st.tree_size
            t += st.draft_s + st.verify_s + st.other_s
        e.release(seq)
        total[(ds, name)][0] += acc
        total[(ds, name)][1] += t
        extra = ""
        if name in variants:
            pr = e.controller.profiler
            extra = ", refits %d, online MAPE %.2f" % (pr.refits, pr.recent_mape())
        row[name] = "%.1f tok/s, tau %.2f, tree %.1f%s" % (acc / t, acc / steps, nodes / steps, extra)
    print(i, ds, flush=True)
    for name in names:
        print("   ", name, row[name], flush=True)
for ds in dict.fromkeys(d for d, _ in prompts):
    r = {n: total[(ds, n)][0] / total[(ds, n)][1] for n in names}
    print(ds, " ".join("%s %.1f (%.2fx)" % (n, v, v / r["ar"]) for n, v in r.items()))
