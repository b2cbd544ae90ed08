"""Compare the merges of the DFlash + suffix hybrid drafter end to end (issue 9).

Loads the embedded default target once, a DFlash drafter (--dflash PATH, or a random
1-layer one, the same as `bastion bench --drafter random`), and runs every variant in
--variants over the first --num-prompts prompts of each dataset in --datasets with the
engine in mode tree-<budget> (greedy; every output is checked against the engine's AR
output). Variants:

    ar            the engine, one node per step (the baseline; always run)
    suffix        SuffixDrafter alone
    dflash        DFlash alone
    MERGE[@w][/sL] HybridDrafter with merge MERGE (mix-tree, max-tree, mix-depth),
                  suffix weight w (default 0.5) and skip_dflash_match L (default 0)

Prints, per dataset and variant: tau (tokens per step, bonus included), decode
tokens/s, speedup over AR, mean tree size, and per step the drafting time and the
hybrid's split (DFlash / suffix / merge, merge in microseconds). Output `--json` too.
Usage: python scripts/bench_hybrid.py [--datasets repeat,humaneval] [--num-prompts 3]
       [--max-new-tokens 64] [--budget 16] [--variants suffix,dflash,mix-tree,max-tree]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.datasets import load_dataset  # noqa: E402
from drafting.hybrid import MERGES, HybridDrafter  # noqa: E402
from drafting.suffix import SuffixDrafter  # noqa: E402
from engine.engine import Engine, make_controller  # noqa: E402
from engine.loader import load_target  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


def make_variant(name: str, dflash):
    """Drafter for a variant name (see the module docstring); None for 'ar'."""
    if name == "ar":
        return None
    if name == "suffix":
        return SuffixDrafter()
    if name == "dflash":
        return dflash
    merge, skip = name, 0
    if "/s" in merge:
        merge, s = merge.split("/s")
        skip = int(s)
    w = 0.5
    if "@" in merge:
        merge, ws = merge.split("@")
        w = float(ws)
    if merge not in MERGES:
        raise SystemExit(f"unknown variant {name}")
    return HybridDrafter(dflash, SuffixDrafter(), merge=merge, weight=w, skip_dflash_match=skip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="repeat,humaneval")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--variants", default="suffix,dflash,mix-tree,max-tree,mix-depth")
    ap.add_argument("--dflash", default=None, help="DFlash checkpoint folder (default: random 1-layer)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BASTION_THREADS", "1")))

    target = load_target(dtype="float32")
    if args.dflash:
        from drafting.dflash import load_dflash
        dflash = load_dflash(args.dflash, target.model)
    else:
        from drafting.dflash import random_dflash
        dflash = random_dflash(target.model, seed=0, num_layers=1, mask_token_id=0)
    ar = Engine(target)
    variants = ["ar"] + [v for v in args.variants.split(",") if v and v != "ar"]
    rows = []
    for ds in args.datasets.split(","):
        prompts = [ar.chat_prompt_ids([{"role": "user", "content": r["prompt"]}])
                   for r in load_dataset(ds, args.num_prompts)]
        refs = None
        ar_tps = None
        for v in variants:
            d = make_variant(v, dflash)
            ctl = make_controller("ar") if d is None else make_controller("tree", args.budget)
            eng = Engine(target, d, ctl)
            toks = steps = acc = nodes = 0
            dec = draft = 0.0
            split = [0.0, 0.0, 0.0, 0]
            outs = []
            for ids in prompts:
                seq = eng.start(ids, SamplingParams(max_tokens=args.max_new_tokens))
                ev = seq.pending
                t0 = time.perf_counter()
                while ev.finish_reason is None:
                    ev = eng.step(seq)
                dec += time.perf_counter() - t0
                outs.append(list(seq.output_ids))
                toks += len(seq.output_ids) - 1
                steps += len(seq.steps)
                acc += sum(s.accepted for s in seq.steps)
                nodes += sum(s.tree_size for s in seq.steps)
                draft += sum(s.draft_s for s in seq.steps)
                st = seq.drafter_state
                if isinstance(d, HybridDrafter):
                    split[0] += st.dflash_s
                    split[1] += st.suffix_s
                    split[2] += st.merge_s
                    split[3] += st.merged
            if refs is None:
                refs = outs
            exact = outs == refs
            tps = toks / dec if dec else 0.0
            if v == "ar":
                ar_tps = tps
            row = dict(dataset=ds, variant=v, tau=acc / steps if steps else 0.0, tokens_per_s=tps,
                       speedup=tps / ar_tps if ar_tps else 0.0, tree_size=nodes / steps if steps else 0.0,
                       draft_ms=1e3 * draft / steps if steps else 0.0, exact=exact,
                       dflash_ms=1e3 * split[0] / steps if steps else 0.0,
                       suffix_ms=1e3 * split[1] / steps if steps else 0.0,
                       merge_us=1e6 * split[2] / split[3] if split[3] else 0.0, merged_steps=split[3], steps=steps)
            rows.append(row)
            print(f"{ds:10s} {v:16s} tau {row['tau']:5.2f}  tok/s {tps:6.1f}  x{row['speedup']:4.2f}  "
                  f"tree {row['tree_size']:5.1f}  draft {row['draft_ms']:6.1f} ms  "
                  f"(dflash {row['dflash_ms']:6.1f} ms, suffix {row['suffix_ms']:5.2f} ms, "
                  f"merge {row['merge_us']:6.0f} us over {split[3]}/{steps} steps)  exact {exact}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
