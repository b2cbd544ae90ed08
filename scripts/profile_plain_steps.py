"""Seconds per engine step of mode ar against bastion restricted to plain steps, to its free
proposals and plain steps, and unrestricted (same loaded target and drafter, math prompts,
96 new tokens, float32, 2 threads). What a plain step costs in bastion beyond AR's
(docs/results/controller_bench.md). Usage: python scripts/profile_plain_steps.py"""
import statistics, time, torch
torch.set_num_threads(2)
from prometheus_client import CollectorRegistry
from bastion.settings import EngineSettings
from bastion.factory import build_engine
from bench.datasets import load_math
from controller.gate import SpeculationGate
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

eng = build_engine(EngineSettings(mode="bastion", dtype=__import__("sys").argv[1] if len(__import__("sys").argv) > 1 else "float32", threads=2))
target, drafter, ctl = eng.target, eng.drafter, eng.controller
ar = Engine(target, None, make_controller("ar"), backend=eng.backend)
prompts = [eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}]) for p in load_math(2)]

def run(e, label):
    tp, parts = [], []
    for ids in prompts:
        seq = e.start(ids, SamplingParams(max_tokens=96))
        t0 = time.perf_counter(); n = 0
        while seq.finish_reason is None:
            ev = e.step(seq); n += 1
            st = ev.step
            parts.append((st.draft_s, st.verify_s, st.other_s, st.tree_size))
        tp.append((time.perf_counter() - t0) / n)
        e.release(seq)
    d, v, o, s = (statistics.mean(p[i] for p in parts) for i in range(4))
    print(f"{label:28s} per step {1e3 * statistics.mean(tp):6.1f} ms  plan {1e3 * d:5.1f}  verify {1e3 * v:5.1f}  other {1e3 * o:5.1f}  tree {s:.2f}")

def restrict(arms):
    """Fresh gates (shared and each request's own) with only these arms."""
    ctl.gate = SpeculationGate(arms=arms); ctl._batch_gates.clear()
    ctl._gate_proto = (ctl.gate.alpha, ctl.gate.explore_every, ctl.gate.arms)

for rep in range(2):
    run(ar, "ar")
    restrict(("plain",))
    run(eng, "bastion, plain arm only")
    restrict(("cheap", "plain"))
    run(eng, "bastion, cheap+plain arms")
    restrict(("draft", "cheap", "plain"))
    run(eng, "bastion, all arms")
