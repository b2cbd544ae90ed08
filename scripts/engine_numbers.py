"""Engine figures for issue 2: AR tokens/s vs transformers generate, per-step overhead, bf16 match rate.

Usage: python scripts/engine_numbers.py [--prompts 20] [--max-tokens 128] [--threads 1] [--out docs/engine_numbers.json]
Prints a Markdown summary and writes JSON. Uses a random DFlash drafter for the tree runs:
acceptance is irrelevant here, only rounding of multi-token forwards and per-step overhead.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from drafting.dflash import random_dflash
from engine.engine import Engine, make_controller
from engine.loader import load_target
from engine.sampling import SamplingParams
from engine.tree import FixedBudgetPolicy, build_tree, tree_attention_mask
from engine.verifier import accept_greedy, compact_cache, verify

PROMPTS = [
    "Describe a rainy afternoon in a small town.", "Explain how a refrigerator works.",
    "Write a short story about a lost key.", "What are the benefits of regular exercise?",
    "Explain the difference between a list and a tuple in Python.", "Give a recipe for pancakes.",
    "Why is the ocean salty?", "Write a poem about autumn leaves.", "How does a bill become a law?",
    "Describe the water cycle.", "What is machine learning?", "Write a letter to a friend about a trip.",
    "Explain photosynthesis to a child.", "List five tips for learning a language.",
    "What causes earthquakes?", "Describe your ideal weekend.", "How do vaccines work?",
    "Explain what a database index is.", "Write a product description for a water bottle.",
    "Why do leaves change color in autumn?",
]


def ar_vs_hf(target, prompts, max_tokens):
    eng = Engine(target)
    ours, hf = [], []
    for p in prompts:
        ids = eng.chat_prompt_ids([{"role": "user", "content": p}])
        r = eng.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        ours.append((len(r.token_ids) - 1) / r.decode_s)
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            target.model.generate(x, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = target.model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            t2 = time.perf_counter()
        n = out.shape[1] - len(ids)
        hf.append((n - 1) / ((t2 - t1) - (t1 - t0)))  # decode only: subtract a prefill + first token
    return statistics.mean(ours), statistics.mean(hf)


def step_overhead(target, drafter, nodes=64, reps=30):
    """ms per step outside the drafter and target forwards: build + mask + accept + compact."""
    eng = Engine(target, drafter, make_controller("tree", nodes))
    ids = eng.chat_prompt_ids([{"role": "user", "content": PROMPTS[0]}])
    seq = eng.start(ids, SamplingParams(max_tokens=reps + 4))
    build, mask, accept, compact = [], [], [], []
    for _ in range(reps):
        prop = drafter.propose(seq.drafter_state, seq.root, 15)
        t0 = time.perf_counter()
        tree = build_tree(seq.root, prop, FixedBudgetPolicy(nodes), 15)
        t1 = time.perf_counter()
        tree_attention_mask(tree, seq.prefix_len, target.model.dtype)
        t2 = time.perf_counter()
        vo = verify(target.model, seq.cache, tree, seq.prefix_len, drafter.feature_layers)
        t3 = time.perf_counter()
        path, bonus = accept_greedy(tree, vo.logits)
        t4 = time.perf_counter()
        compact_cache(seq.cache, seq.prefix_len, path)
        drafter.extend(seq.drafter_state, tree.tokens[path].tolist(), vo.features[path])
        t5 = time.perf_counter()
        seq.prefix_len += len(path)
        seq.root = bonus
        build.append(t1 - t0); mask.append(t2 - t1); accept.append(t4 - t3); compact.append(t5 - t4)
    ms = lambda v: round(1e3 * statistics.median(v), 3)  # noqa: E731
    return {"build_ms": ms(build), "mask_ms": ms(mask), "accept_ms": ms(accept), "compact_ms": ms(compact),
            "total_ms": round(ms(build) + ms(mask) + ms(accept) + ms(compact), 3)}


def match_rate(target, drafter, prompts, max_tokens, budget=32):
    ar = Engine(target)
    tree = Engine(target, drafter, make_controller("tree", budget))
    same, first_diff = 0, []
    for p in prompts:
        ids = ar.chat_prompt_ids([{"role": "user", "content": p}])
        a = ar.generate(ids, SamplingParams(max_tokens=max_tokens)).token_ids
        b = tree.generate(ids, SamplingParams(max_tokens=max_tokens)).token_ids
        if a == b:
            same += 1
        else:
            first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return same, first_diff


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="docs/engine_numbers.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    res = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "max_tokens": a.max_tokens}
    prompts = PROMPTS[: a.prompts]
    for dt in ("float32", "bfloat16"):
        tg = load_target(dtype=dt)
        d = random_dflash(tg.model, num_layers=1, mask_token_id=0)
        ours, hf = ar_vs_hf(tg, prompts[:5], a.max_tokens)
        res[dt] = {"engine_ar_tokens_per_s": round(ours, 2), "hf_generate_tokens_per_s": round(hf, 2),
                   "step_overhead_64_nodes": step_overhead(tg, d)}
        same, diffs = match_rate(tg, d, prompts, a.max_tokens)
        res[dt]["tree32_equal_to_ar"] = f"{same}/{len(prompts)}"
        res[dt]["first_divergence_token"] = diffs
        print(json.dumps(res, indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
