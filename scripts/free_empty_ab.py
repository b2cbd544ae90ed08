"""Single-stream A/B of the free-proposal fallback: bastion as shipped (a free-proposal step whose
proposal is empty goes to the better of the full draft and plain decoding, `free_empty`) against a
copy of its controller without it (such a step runs plain), with AR and fixed trees beside them;
every mode runs each prompt in turn (order shifted per prompt), passes over the prompts repeated,
each bastion controller keeping its state across prompts as when serving. Prints tok/s per dataset
and mode, bastion's ratio to the best fixed tree per pass, and the step kinds of both controllers.
Usage: python scripts/free_empty_ab.py DTYPE [DATASET:N ...] [--tokens 128] [--passes 3] [--fixed 4,8]"""
import argparse, collections, copy, statistics, time
import torch
from bastion.factory import build_engine
from bastion.settings import EngineSettings
from bench.datasets import load_dataset
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("dtype")
ap.add_argument("sets", nargs="*", default=["mt-bench:3", "humaneval:3", "math:3"])
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--passes", type=int, default=3)
ap.add_argument("--fixed", default="4,8")
args = ap.parse_args()
torch.set_num_threads(2)
eng = build_engine(EngineSettings(mode="bastion", dtype=args.dtype, threads=2))
ctl = eng.controller
metrics, ctl.metrics = ctl.metrics, None
old = copy.deepcopy(ctl)
ctl.metrics = old.metrics = metrics
old.free_empty = None  # the engine then runs an empty free-proposal step plain, as before
engines = {"ar": Engine(eng.target, None, make_controller("ar"), backend=eng.backend)}
for n in args.fixed.split(","):
    engines[f"tree-{n}"] = Engine(eng.target, eng.drafter, make_controller("tree", int(n)), backend=eng.backend)
engines["bastion"] = eng
engines["plain-if-empty"] = Engine(eng.target, eng.drafter, old, backend=eng.backend)
prompts = []
for spec in args.sets:
    name, _, n = spec.partition(":")
    prompts += [(name, eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}]))
                for p in load_dataset(name, int(n or 3))]
names = list(engines)
tot = collections.defaultdict(lambda: [0, 0.0])  # (pass, dataset, mode) -> tokens, seconds
for e in engines.values():  # warm-up
    e.generate(prompts[0][1], SamplingParams(max_tokens=16))
i = 0
for rep in range(args.passes):
    for name, ids in prompts:
        order = names[i % len(names):] + names[:i % len(names)]
        i += 1
        for mode in order:
            t0 = time.perf_counter()
            r = engines[mode].generate(ids, SamplingParams(max_tokens=args.tokens))
            dt = time.perf_counter() - t0
            tot[(rep, name, mode)][0] += len(r.token_ids)
            tot[(rep, name, mode)][1] += dt
    print(f"pass {rep} done", flush=True)
datasets = list(dict.fromkeys(n for n, _ in prompts))
fixed = [m for m in names if m.startswith("tree-")]
for ds in datasets:
    rate = {m: [tot[(p, ds, m)][0] / tot[(p, ds, m)][1] for p in range(args.passes)] for m in names}
    line = "  ".join(f"{m} {statistics.median(v):5.1f}" for m, v in rate.items())
    print(f"{ds:10s} tok/s (median of passes): {line}")
    for m in ("bastion", "plain-if-empty"):
        ratios = [rate[m][p] / max(rate[f][p] for f in fixed) for p in range(args.passes)]
        print(f"{'':10s} {m} / best fixed per pass: " + " ".join(f"{x:.3f}" for x in ratios) +
              f"  (median {statistics.median(ratios):.3f}; over AR {statistics.median(rate[m]) / statistics.median(rate['ar']):.2f}x)")
for m in ("bastion", "plain-if-empty"):
    print(m, "steps", engines[m].controller.step_kinds, "gate", {a: round(v, 2) if v else v for a, v in engines[m].controller.gate.gain.items()})
