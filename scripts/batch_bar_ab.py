"""The bar of one batch-size class at one concurrency: bastion with the shipped controller against a
copy whose class of CLASS sequences (batches of CLASS/2 + 1 .. CLASS; default 2), and its requests' own
gates in batches of that class, use another bar, with batched AR and a fixed tree beside them; modes
interleaved per pass (order shifted), closed-loop clients as `bastion bench --concurrency` runs them,
float32.
Usage: python scripts/batch_bar_ab.py [CLIENTS] [PASSES] [BAR] [--class CLASS] [--tree N]"""
import argparse, copy, statistics
import torch
import controller.budget as B
from bastion.concurrency import run_cell
from bastion.factory import build_engine
from bastion.settings import EngineSettings
from bench.datasets import load_dataset
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("clients", nargs="?", type=int, default=2)
ap.add_argument("passes", nargs="?", type=int, default=4)
ap.add_argument("bar", nargs="?", type=float, default=1.1)
ap.add_argument("--tree", type=int, default=4, help="0: no fixed tree")
ap.add_argument("--class", dest="size_class", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(2)
eng = build_engine(EngineSettings(mode="bastion", dtype="float32", threads=2), max_batch=8)
ctl = eng.controller
metrics, ctl.metrics = ctl.metrics, None
alt = copy.deepcopy(ctl)
ctl.metrics = alt.metrics = metrics


class Alt(B.BudgetController):
    @staticmethod
    def batch_bar(batch_size):
        if B.BudgetController.size_class(batch_size) == args.size_class:
            return args.bar
        return B.BudgetController.batch_bar(batch_size)


alt.__class__ = Alt
engines = {"ar": Engine(eng.target, None, make_controller("ar"), backend=eng.backend)}
if args.tree:  # --tree 0: no fixed tree
    engines[f"tree-{args.tree}"] = Engine(eng.target, eng.drafter, make_controller("tree", args.tree), backend=eng.backend)
engines.update({"bastion": eng, f"bar-{args.bar}": Engine(eng.target, eng.drafter, alt, backend=eng.backend)})
prompts = [eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}])
           for ds in ("mt-bench", "humaneval", "math") for p in load_dataset(ds, 3)]
for name, e in engines.items():
    run_cell(e, name, prompts[:1], 1, 1, SamplingParams(max_tokens=4))
res = {n: [] for n in engines}
names = list(engines)
for rep in range(args.passes):
    order = names[rep % len(names):] + names[:rep % len(names)]
    for name in order:
        cell = run_cell(engines[name], name, prompts, args.clients, 3, SamplingParams(max_tokens=64))
        res[name].append(cell.tokens_per_s)
        print(f"pass {rep} {name}: {cell.tokens_per_s:.1f} tok/s, batch {cell.mean_batch:.2f}, "
              f"{cell.nodes_per_forward:.2f} nodes/forward", flush=True)
for n, xs in res.items():
    print(f"{n:12s} median {statistics.median(xs):6.1f} tok/s  passes " + " ".join(f"{x:.1f}" for x in xs))
alt_name = names[-1]
print("paired bar/shipped:", " ".join(f"{a / b:.2f}" for a, b in zip(res[alt_name], res["bastion"])))
