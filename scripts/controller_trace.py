"""Per-step trace of the adaptive controller against fixed trees on the same loaded target and
drafter: tokens/s per mode, and for bastion the steps of each kind (plain, free proposal, full
draft) with their phase times, tree sizes and tokens. Modes run interleaved per prompt; the
bastion controller keeps its state across prompts, as when serving.
Usage: python scripts/controller_trace.py DTYPE [DATASET:N ...] [--tokens 128] [--passes 2]"""
import argparse, collections, json, statistics, time
import torch
from bastion.settings import EngineSettings
from bastion.factory import build_engine
from bench.datasets import load_dataset
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("dtype")
ap.add_argument("sets", nargs="*", default=["humaneval:2", "mt-bench:2"])
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--passes", type=int, default=2)
ap.add_argument("--fixed", default="4,8")
ap.add_argument("--sequence", action="store_true", help="print each bastion request's steps: kind letter, tokens")
ap.add_argument("--slow", type=float, default=0.0, help="print bastion steps whose verify took more ms")
args = ap.parse_args()
torch.set_num_threads(2)
eng = build_engine(EngineSettings(mode="bastion", dtype=args.dtype, threads=2))
engines = {"ar": Engine(eng.target, None, make_controller("ar"), backend=eng.backend)}
for n in args.fixed.split(","):
    engines[f"tree-{n}"] = Engine(eng.target, eng.drafter, make_controller("tree", int(n)), backend=eng.backend)
engines["bastion"] = eng
prompts = []
for spec in args.sets:
    name, _, n = spec.partition(":")
    prompts += [(name, eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}]))
                for p in load_dataset(name, int(n or 2))]
for e in engines.values():  # one short warm-up request per mode, as `bastion bench` runs
    seq = e.start(prompts[0][1], SamplingParams(max_tokens=16))
    while seq.finish_reason is None:
        e.step(seq)
    e.release(seq)
tot = collections.defaultdict(lambda: [0, 0.0])
phases = collections.defaultdict(float)  # the steps' own phase times, to compare with the wall time
kinds = collections.defaultdict(list)
for _ in range(args.passes):
    for name, ids in prompts:
        for mode, e in engines.items():
            seq = e.start(ids, SamplingParams(max_tokens=args.tokens))
            t0 = time.perf_counter()
            prev = "prefill"
            letters = []
            while seq.finish_reason is None:
                st = e.step(seq).step
                phases[(name, mode)] += st.draft_s + st.verify_s + st.other_s
                if mode == "bastion":
                    kind = "draft" if st.drafted else "cheap" if st.cheap else "plain"
                    if st.cheap and e.controller._last_free:
                        kind = "free"
                    kinds[kind].append(st)
                    if args.slow and st.verify_s > args.slow / 1e3:
                        print(f"slow {kind} step: tree {st.tree_size} context {st.context_len} verify "
                              f"{1e3 * st.verify_s:.1f} ms, refits so far {e.controller.profiler.refits}")
                    kinds[f"{kind} after {prev}"].append(st)
                    letters.append(f"{kind[0].upper()}{st.accepted}")
                    prev = kind
                else:
                    kinds[mode].append(st)
            dt = time.perf_counter() - t0
            if letters and args.sequence:
                g = getattr(seq.control, "solo", None)
                print(f"{name} bastion: {' '.join(letters)}")
                if g is not None:
                    print("   request gate", {a: round(v, 2) if v else v for a, v in g.gain.items()},
                          "shared", {a: round(v, 2) if v else v for a, v in e.controller.gate.gain.items()})
            tot[(name, mode)][0] += seq.n_out - 1
            tot[(name, mode)][1] += dt
            e.release(seq)
for (name, mode), (n, s) in sorted(tot.items()):
    print(f"{name:10s} {mode:8s} {n / s:6.1f} tok/s  ({n / s / (tot[(name, 'ar')][0] / tot[(name, 'ar')][1]):.2f}x AR)"
          f"  wall {s:.2f} s, steps' phases {phases[(name, mode)]:.2f} s")
for k, sts in kinds.items():
    m = lambda f: statistics.mean(f(s) for s in sts)
    print(f"bastion {k:6s} {len(sts):4d} steps: draft {1e3*m(lambda s: s.draft_s):5.1f} verify {1e3*m(lambda s: s.verify_s):5.1f} "
          f"other {1e3*m(lambda s: s.other_s):4.1f} ms, tree {m(lambda s: s.tree_size):5.2f}, tokens {m(lambda s: s.accepted):.2f}, "
          f"A_hat {m(lambda s: s.a_hat):.2f}")
snap = eng.controller.snapshot()
print(json.dumps({k: snap[k] for k in ("steps", "gate", "t_draft_s", "t_other_s", "sizes")}, default=str))
print("surrogate", json.dumps({k: snap["surrogate"].get(k) for k in ("mean_predicted", "mean_realised", "reliability")}, default=str))
