"""What one arm's steps commit against their predicted A_hat: every step of bastion forced to one
arm (the free proposal alone, or the full draft), on 3 prompts each of mt-bench, humaneval and
math, 128 new tokens; per dataset the mean tokens and ms a step, then per A_hat bin (0.5 wide)
the steps' mean tokens, tree size and ms. Measures how well a free tree's A_hat tells a good
step from a poor one (docs/method.md, section 8, "Free proposals first").
Usage: python scripts/arm_step_table.py DTYPE"""
import collections, statistics as stats, sys
import torch
from bastion.settings import EngineSettings
from bastion.factory import build_engine
from bench.datasets import load_dataset
from controller.gate import SpeculationGate
from engine.sampling import SamplingParams

torch.set_num_threads(2)
eng = build_engine(EngineSettings(mode="bastion", dtype=sys.argv[1] if len(sys.argv) > 1 else "float32", threads=2))
ctl = eng.controller
rows = []
for arm in ("cheap", "draft"):
    ctl.gate = SpeculationGate(arms=(arm,))  # the shared gate and every request's own: this arm only
    ctl._gate_proto = (ctl.gate.alpha, ctl.gate.explore_every, ctl.gate.arms)
    for name in ("mt-bench", "humaneval", "math"):
        for p in load_dataset(name, 3):
            seq = eng.start(eng.chat_prompt_ids([{"role": "user", "content": p["prompt"]}]),
                            SamplingParams(max_tokens=128))
            while seq.finish_reason is None:
                st = eng.step(seq).step
                rows.append((arm, name, st.a_hat, st.accepted, st.tree_size,
                             st.draft_s + st.verify_s + st.other_s, st.cheap or st.drafted))
            eng.release(seq)
for arm in ("cheap", "draft"):
    mine = [r for r in rows if r[0] == arm]
    for name in ("mt-bench", "humaneval", "math"):
        x = [r for r in mine if r[1] == name]
        print(f"{arm:5s} {name:9s}: {len(x)} steps, {sum(r[6] for r in x)} with a proposal, "
              f"{stats.mean(r[3] for r in x):.2f} tokens, {1e3 * stats.mean(r[5] for r in x):.1f} ms a step")
    bins = collections.defaultdict(list)
    for r in mine:
        if r[6]:
            bins[min(int(r[2] * 2) / 2, 5.0)].append(r)
    for b in sorted(bins):
        x = bins[b]
        print(f"      A_hat {b:.1f}: {len(x):4d} steps, {stats.mean(r[3] for r in x):.2f} tokens, "
              f"tree {stats.mean(r[4] for r in x):.1f}, {1e3 * stats.mean(r[5] for r in x):.1f} ms")
