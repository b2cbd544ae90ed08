"""Micro-benchmark of the suffix drafter's per-step cost (issue 9: well under 1 ms at 4k context).

Text: long Python files from the standard library, split on whitespace and mapped to
integer ids (a stand-in for a tokenizer: code repeats itself, as real prompts do).
The first `--context` tokens are the prompt; then the script replays a continuation as
a greedy decode. `--scenario code` continues with the file's next tokens;
`--scenario edit` continues with a copy of the prompt in which 2% of the tokens are
replaced (a "rewrite this code" request, the case suffix drafting targets). Per step
it proposes from the true next token (the root), takes the longest tree path that matches the true continuation as accepted, and extends the
state with the root plus the accepted tokens.

Unless --no-gc-freeze, the heap left by imports (torch) is frozen out of the cyclic
GC first, so full collections do not add tens of ms to random steps. Prints the prompt
indexing time, then mean / p50 / p99 / max of propose() (wall clock, and thread CPU
time, which leaves out preemption on a shared machine) and of extend() per step in
microseconds, and the mean accepted length per step.
Usage: python scripts/bench_suffix.py [--context 4096] [--steps 2000] [--scenario code|edit]
                                      [--global-tokens 0]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from drafting.suffix import SuffixDrafter  # noqa: E402


def stdlib_tokens(min_tokens: int) -> list[int]:
    """Whitespace tokens of a few large stdlib modules, mapped to ints in order of first appearance."""
    import argparse as m1
    import inspect as m2
    import typing as m3
    import pathlib as m4
    import dataclasses as m5
    vocab: dict[str, int] = {}
    out: list[int] = []
    for mod in (m1, m2, m3, m4, m5):
        for w in inspect.getsource(mod).split():
            out.append(vocab.setdefault(w, len(vocab)))
        if len(out) >= min_tokens:
            break
    return out


def accepted_len(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Length of the longest tree path equal to a prefix of `truth`."""
    best, depth_ok = 0, {-1: 0}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = depth_ok.get(p)
        if d is not None and d < len(truth) and truth[d] == t:
            depth_ok[i] = d + 1
            best = max(best, d + 1)
    return best


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--max-depth", type=int, default=15)
    ap.add_argument("--max-candidates", type=int, default=64)
    ap.add_argument("--global-tokens", type=int, default=0)
    ap.add_argument("--scenario", choices=("code", "edit"), default="code")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="keep the import-time heap in the cyclic GC's view (full collections then "
                         "cost tens of ms and land on random steps)")
    args = ap.parse_args()

    text = stdlib_tokens(args.context + 4 * args.steps)
    if len(text) < args.context + 2:
        raise SystemExit(f"only {len(text)} tokens of text")
    if args.scenario == "edit":
        rng = random.Random(0)
        prompt = text[:args.context]
        vocab = max(text) + 1
        copy = [rng.randrange(vocab) if rng.random() < 0.02 else t for t in prompt]
        text = prompt + copy * (1 + (args.steps * (args.max_depth + 1)) // len(copy))
    d = SuffixDrafter(max_depth=args.max_depth, max_candidates=args.max_candidates,
                      global_tokens=args.global_tokens)
    if d.global_index is not None:  # fill the global index with a previous "request"
        g = d.new_state()
        d.extend(g, text[:16], None)
        d.extend(g, text[16:args.context], None)
        d.finish(g)
    if not args.no_gc_freeze:  # what a server does after loading: move the startup heap out of GC scans
        gc.collect()
        gc.freeze()
    st = d.new_state()
    t0 = time.perf_counter()
    d.extend(st, text[:args.context], None)
    t_prompt = time.perf_counter() - t0

    prop_us: list[float] = []
    prop_cpu_us: list[float] = []
    ext_us: list[float] = []
    acc: list[int] = []
    sizes: list[int] = []
    pos = args.context
    wall, cpu = time.perf_counter, time.thread_time
    while len(prop_us) < args.steps and pos + 1 < len(text):
        root = text[pos]
        c0, t0 = cpu(), wall()
        ct = d.propose(st, root, args.max_depth)
        t1, c1 = wall(), cpu()
        a = accepted_len(ct.tokens.tolist(), ct.parents.tolist(), text[pos + 1:pos + 1 + args.max_depth])
        committed = text[pos:pos + 1 + a]
        t2 = wall()
        d.extend(st, committed, None)
        t3 = wall()
        prop_us.append((t1 - t0) * 1e6)
        prop_cpu_us.append((c1 - c0) * 1e6)
        ext_us.append((t3 - t2) * 1e6)
        acc.append(a)
        sizes.append(int(ct.tokens.shape[0]))
        pos += 1 + a

    n = len(prop_us)
    print(f"prompt: {args.context} tokens indexed in {t_prompt * 1e3:.1f} ms "
          f"({t_prompt / args.context * 1e6:.2f} us/token), {st.index.num_states} states")
    print(f"steps: {n}, context {args.context} -> {len(st.tokens)} tokens, "
          f"mean candidates {statistics.fmean(sizes):.1f}, matched {st.matched}/{st.proposals}")
    for name, xs in (("propose", prop_us), ("propose (thread CPU time)", prop_cpu_us), ("extend", ext_us)):
        print(f"{name:25s} us: mean {statistics.fmean(xs):7.1f}  p50 {pct(xs, 0.5):7.1f}  "
              f"p99 {pct(xs, 0.99):7.1f}  max {max(xs):7.1f}")
    print(f"accepted per step (excluding the root): mean {statistics.fmean(acc):.2f}")


if __name__ == "__main__":
    main()
