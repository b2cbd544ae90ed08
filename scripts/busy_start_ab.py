"""A busy start-up, then a quiet machine: the calibration and the gate's priming run beside a
one-thread matmul loop, which is then stopped; the controller is copied, and the copy keeps the
plain baseline's old rule (every plain step of the last 16 counts, whatever its age; no refresh).
Both, AR, tree-4 and tree-8 run interleaved per prompt (128 tokens); after each prompt the two
gates and plain baselines are printed, at the end tokens/s per dataset.
Usage: python scripts/busy_start_ab.py DTYPE [DATASET:N ...]"""
import collections
import copy
import subprocess
import sys

import torch
torch.set_num_threads(2)
busy = subprocess.Popen([sys.executable, "-c", "import numpy as np\na=np.random.rand(700,700)\nwhile True:\n a=a@a; a/=np.abs(a).max()"], env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin"})
from bastion.settings import EngineSettings
from bastion.factory import build_engine
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from bench.datasets import load_dataset
import controller.budget as B
eng = build_engine(EngineSettings(mode="bastion", dtype=sys.argv[1], threads=2))
busy.kill()
ctl = eng.controller
metrics = ctl.metrics
ctl.metrics = None
old = copy.deepcopy(ctl)
ctl.metrics = old.metrics = metrics
class Old(B.BudgetController):
    def _fresh_plain(self, b):
        return bool(self._plain.get(b))
    def refresh_plain(self, gate, b):
        pass
old.__class__ = Old
eng_old = Engine(eng.target, eng.drafter, old, backend=eng.backend)
ar = Engine(eng.target, None, make_controller("ar"), backend=eng.backend)
t8 = Engine(eng.target, eng.drafter, make_controller("tree", 8), backend=eng.backend)
t4 = Engine(eng.target, eng.drafter, make_controller("tree", 4), backend=eng.backend)
print("calibration spread %.2f" % ctl.calibration.spread)
sets = sys.argv[2:] or ["mt-bench:4", "humaneval:2"]
prompts = []
for spec in sets:
    name, _, n = spec.partition(":")
    prompts += [(name, eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}])) for p in load_dataset(name, int(n))]
modes = [("new", eng), ("old", eng_old), ("ar", ar), ("tree-4", t4), ("tree-8", t8)]
tot = collections.defaultdict(lambda: [0, 0.0])
for i, (ds, ids) in enumerate(prompts):
    k = i % len(modes)
    for name, e in modes[k:] + modes[:k]:
        seq = e.start(ids, SamplingParams(max_tokens=128))
        while seq.finish_reason is None:
            st = e.step(seq).step
            tot[(ds, name)][0] += st.accepted; tot[(ds, name)][1] += st.draft_s + st.verify_s + st.other_s
        e.release(seq)
    print(i, ds, "new gate", {k: round(v, 2) for k, v in ctl.gate.gain.items() if v}, "old gate", {k: round(v, 2) for k, v in old.gate.gain.items() if v},
          "plain baseline new %.1f old %.1f ms" % (1e3 * ctl.plain_step_seconds(400), 1e3 * old.plain_step_seconds(400)), flush=True)
for ds in dict.fromkeys(d for d, _ in prompts):
    r = {n: tot[(ds, n)][0] / tot[(ds, n)][1] for n, _ in modes}
    print(ds, " ".join("%s %.1f (%.2fx)" % (n, v, v / r["ar"]) for n, v in r.items()))
print("steps new", ctl.step_kinds, "old", old.step_kinds)
