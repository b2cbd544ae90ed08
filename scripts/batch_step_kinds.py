"""Batched steps by kind at CLIENTS clients (default 8): bastion and AR served through the scheduler (closed-loop
clients, as `bastion bench --concurrency` runs them), each engine step timed and classed (plain,
free proposal, full draft; with or without a prompt chunk riding along), for one float32 engine.
Prints each cell's tokens/s and, per (mode, kind, batch size) for batches of CLIENTS - 1 .. CLIENTS (at least 2) without prompt
chunks, the step's wall and phase times, nodes and tokens per sequence, and where each cell's
time went. Usage: python scripts/batch_step_kinds.py [PASSES] [--clients CLIENTS] [--out FILE.json]"""
import argparse, collections, json, statistics, time
import torch
from bastion.concurrency import run_cell
from bastion.factory import build_engine
from bastion.settings import EngineSettings
from bench.datasets import load_dataset
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("passes", nargs="?", type=int, default=2)
ap.add_argument("--clients", type=int, default=8)
ap.add_argument("--out", default=None)
args = ap.parse_args()
torch.set_num_threads(2)
eng = build_engine(EngineSettings(mode="bastion", dtype="float32", threads=2), max_batch=8)
ar = Engine(eng.target, None, make_controller("ar"), backend=eng.backend)
prompts = [eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}])
           for ds in ("mt-bench", "humaneval", "math") for p in load_dataset(ds, 3)]
log = []
for e, name in ((eng, "bastion"), (ar, "ar")):
    inner = e._step_mixed

    def timed(seqs, pre, chunks, inner=inner, name=name):
        t0 = time.perf_counter()
        out = inner(seqs, pre, chunks)
        st = [s.steps[-1] for s in seqs if s.steps]
        kind = "draft" if any(x.drafted for x in st) else "cheap" if any(x.cheap for x in st) else "plain"
        log.append(dict(mode=name, b=len(seqs), pre=len(chunks), wall=time.perf_counter() - t0, kind=kind,
                        nodes=sum(x.tree_size for x in st), acc=sum(x.accepted for x in st),
                        phases=(st[-1].draft_s + st[-1].verify_s + st[-1].other_s) if st else 0.0))
        return out
    e._step_mixed = timed
for e, name in ((eng, "bastion"), (ar, "ar")):
    run_cell(e, name, prompts[:1], 1, 1, SamplingParams(max_tokens=4))
del log[:]
for rep in range(args.passes):
    for e, name in ((ar, "ar"), (eng, "bastion")) if rep % 2 == 0 else ((eng, "bastion"), (ar, "ar")):
        start = len(log)
        cell = run_cell(e, name, prompts, args.clients, 3, SamplingParams(max_tokens=64))
        rs = log[start:]
        for r in rs:
            r["rep"] = rep
        print(f"{name} pass {rep}: {cell.tokens_per_s:.1f} tok/s, batch {cell.mean_batch:.2f}, "
              f"{cell.nodes_per_forward:.2f} nodes/forward; time in steps with prompt chunks "
              f"{sum(r['wall'] for r in rs if r['pre']):.1f} s, in steps of fewer than {args.clients} sequences without "
              f"{sum(r['wall'] for r in rs if r['b'] < args.clients and not r['pre']):.1f} s", flush=True)
groups = collections.defaultdict(list)
for r in log:
    if r["pre"] == 0 and r["b"] >= max(args.clients - 1, 2):
        groups[(r["mode"], r["kind"], r["b"])].append(r)
for key, rs in sorted(groups.items()):
    print(key, "steps %d, wall %.1f ms, phases %.1f ms, nodes %.1f, tokens/seq %.2f" % (
        len(rs), 1e3 * statistics.median(r["wall"] for r in rs), 1e3 * statistics.median(r["phases"] for r in rs),
        statistics.fmean(r["nodes"] for r in rs), statistics.fmean(r["acc"] / r["b"] for r in rs)))
print(json.dumps(eng.controller.snapshot()["batch_gates"]))
if args.out:
    with open(args.out, "w") as f:
        json.dump(log, f)
