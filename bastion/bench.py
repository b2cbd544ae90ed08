"""`bastion bench`: AR, chain, fixed-budget trees, BASTION and prompt lookup side by side on benchmark prompts.

Examples:
    bastion bench --quick --drafter random          # a few minutes on a CPU, for development
    bastion bench --drafter PATH --out runs/bench   # the full run; rerun the same line to resume
    bastion bench --prompts-file mine.jsonl --modes ar,bastion --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bench.datasets import DATASETS
from bench.modes import BASE_MODES, build_modes, expand_modes, needs_drafter

log = logging.getLogger(__name__)

DEFAULT_DATASETS = ("mt-bench", "humaneval", "math")
DEFAULT_BUDGETS = {"cpu": (16, 64), "gpu": (64, 256, 1024)}
DEFAULT_MAX_NEW = {"cpu": 256, "gpu": 2048}
#: --quick: one prompt of each default dataset, short answers, one tree budget.
QUICK = {"num_prompts": 1, "max_new_tokens": 32, "budgets": (32,)}


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _int_csv(s: str) -> list[int]:
    try:
        return [int(x) for x in _csv(s)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{s}'") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `bastion bench` (the engine's --target --drafter --dtype --device --threads included)."""
    from bastion.settings import add_engine_arguments

    add_engine_arguments(p)
    for a in p._actions:  # the bench takes --modes / --budgets instead of the engine's --mode / --budget
        if a.dest in ("mode", "budget"):
            a.help = argparse.SUPPRESS
        if a.dest == "drafter":
            a.help = ("drafter spec: a DFlash checkpoint folder or HF id, 'random' (a random 1-layer DFlash, "
                      "a lower bound), or 'none' (default: the shipped drafter of the default target, if any)")
    p.add_argument("--datasets", type=_csv, default=None,
                   help=f"comma-separated prompt sets from {', '.join(DATASETS)} "
                        f"(default: {','.join(DEFAULT_DATASETS)}; none when --prompts-file is given)")
    p.add_argument("--prompts-file", action="append", default=[], metavar="FILE.jsonl",
                   help="JSONL prompt set (one object per line: prompt, optional id, kind, turns); "
                        "a dataset named after the file (repeatable)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each dataset (default: all)")
    p.add_argument("--multi-turn", action="store_true", help="feed every turn (MT-Bench turn 2 after the model's own answer)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 256 on CPU, 2048 on GPU (32 with --quick)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy, with the exactness check")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--modes", type=_csv, default=None,
                   help=f"comma-separated, run interleaved per prompt: {', '.join(BASE_MODES)}, tree-N "
                        "('tree' = tree-N for each of --budgets); default all of them, or with --concurrency "
                        "serial-ar,ar,tree-4,tree-16,tree-64,bastion")
    p.add_argument("--budgets", type=_int_csv, default=None,
                   help="tree sizes for 'tree' (default 16,64 on CPU, 64,256,1024 on GPU; 32 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed base (per prompt: derived) and random drafter seed")
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/bench, runs/bench-quick with --quick)")
    p.add_argument("--quick", action="store_true", help="one prompt per dataset, 32 new tokens, budget 32: minutes on a CPU")
    p.add_argument("--fresh", action="store_true", help="ignore an earlier results.json in --out instead of resuming")
    p.add_argument("--no-warmup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--concurrency", type=_int_csv, default=None, metavar="K,K,...",
                   help="instead of one request at a time: K closed-loop clients per cell against the batching "
                        "scheduler, for each K (modes default serial-ar,ar,tree-4,tree-16,tree-64,bastion; "
                        "writes DIR/concurrency.json and concurrency.md)")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests each client sends per --concurrency cell (default 2)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every prompt (or --concurrency cell) this many times, mode order rotated per pass; "
                        "times and speedups are medians over passes (default 1)")


def run(args) -> int:
    """Load the target and drafter once, build the modes, run, write DIR/results.json, report.md, plot.png."""
    import torch

    from bench.runner import BenchSettings, environment, load_prompt_sets, run_bench
    from bastion.factory import build_budget_controller, no_drafter_reason, resolve_drafter, warm_kernels
    from bastion.settings import settings_from_args
    from engine.loader import load_target

    kind = "gpu" if torch.device(args.device).type == "cuda" else "cpu"
    budgets = args.budgets or list(QUICK["budgets"] if args.quick else DEFAULT_BUDGETS[kind])
    max_new = args.max_new_tokens or (QUICK["max_new_tokens"] if args.quick else DEFAULT_MAX_NEW[kind])
    num_prompts = args.num_prompts if args.num_prompts is not None else (QUICK["num_prompts"] if args.quick else None)
    names = args.datasets if args.datasets is not None else ([] if args.prompts_file else list(DEFAULT_DATASETS))
    out = args.out or Path("runs/bench-quick" if args.quick else "runs/bench")
    if max_new < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.concurrency is not None:
        if not args.concurrency or min(args.concurrency) < 1 or args.requests_per_client < 1 or args.repeats < 1:
            raise ValueError("--concurrency needs levels >= 1, --requests-per-client >= 1 and --repeats >= 1")
        from bastion.concurrency import CONCURRENCY_MODES

        requested = args.modes or list(CONCURRENCY_MODES)
        bad = [m for m in requested if m in ("ar-hf", "pld")]
        if bad:
            raise ValueError(f"--concurrency serves engine modes only, not {', '.join(bad)}")
        modes = [m for m in expand_modes([m for m in requested if m != "serial-ar"], budgets)]
        if "serial-ar" in requested:
            modes.insert(requested.index("serial-ar"), "serial-ar")
    else:
        modes = expand_modes(args.modes or list(BASE_MODES), budgets)

    prompt_sets, skipped_ds = load_prompt_sets(names, args.prompts_file, num_prompts)
    for name, why in skipped_ds.items():
        print(f"bastion bench: skipping dataset {name}: {why}", file=sys.stderr)
    if not prompt_sets:
        raise ValueError("no prompt set could be loaded")

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target, args.dtype, args.device)
    drafter, drafter_desc = resolve_drafter(args.drafter, target, seed=args.seed, drafter_dtype=args.drafter_dtype)
    dflash = getattr(drafter, "dflash", drafter)  # a hybrid's DFlash part
    if getattr(dflash, "dtype", None) is not None and dflash.dtype != target.dtype:
        drafter_desc += f" (drafter in {str(dflash.dtype).removeprefix('torch.')})"
    skipped_modes = {}
    if drafter is None:
        why = no_drafter_reason(args.drafter, target)
        for m in modes:
            if needs_drafter(m):
                skipped_modes[m] = f"needs a drafter: {why}"
        if skipped_modes:
            print(f"bastion bench: skipping {', '.join(skipped_modes)}: {why}", file=sys.stderr)
        modes = [m for m in modes if m not in skipped_modes]
        if not modes:
            raise ValueError("every selected mode needs a drafter, and there is none")

    warm_kernels(target, drafter)
    calibration = {}

    def bastion_controller(surrogate_correction: bool = True):
        controller = build_budget_controller(target, drafter, settings_from_args(args), progress=True,
                                      surrogate_correction=surrogate_correction)
        cal = getattr(controller, "calibration", None)
        if cal is not None:
            calibration.update(cal.to_json(), from_cache=cal.from_cache)
        return controller

    if args.concurrency is not None:
        return _run_concurrency(args, target, drafter, modes, prompt_sets, bastion_controller, max_new, out)
    mode_objs = build_modes(modes, target, drafter, bastion_controller)
    settings = BenchSettings(
        target=target.name, drafter=drafter_desc, dtype=str(target.dtype).removeprefix("torch."), device=args.device,
        modes=modes,
        max_new_tokens=max_new, temperature=args.temperature, seed=args.seed, multi_turn=args.multi_turn,
        ignore_eos=args.ignore_eos, num_prompts=num_prompts, budgets=budgets, repeats=args.repeats,
    )
    env = environment(target, drafter_desc, args.device, calibration or None)
    n = sum(len(v) for v in prompt_sets.values())
    print(f"bastion bench: {n} prompts x {len(modes)} modes ({', '.join(modes)}), max {max_new} new tokens, "
          f"{args.repeats} pass{'es' if args.repeats > 1 else ''}, out {out}", file=sys.stderr)
    res = run_bench(settings, target, mode_objs, prompt_sets, out, env=env,
                    skipped={"modes": skipped_modes, "datasets": skipped_ds}, fresh=args.fresh,
                    warmup=not args.no_warmup, progress=not args.no_progress)
    from bench.report import markdown_table

    print(markdown_table(res["summary"], settings.datasets, settings.modes))
    print(f"\nresults: {out / 'results.json'}, report: {out / 'report.md'}, plot: {out / 'plot.png'}", file=sys.stderr)
    bad = [s for s in res["summary"] if s["mismatches"]]
    if bad:
        print("bastion bench: outputs differ from the reference for "
              + ", ".join(f"{s['mode']} on {s['dataset']} ({s['mismatches']})" for s in bad), file=sys.stderr)
    return 0


def _run_concurrency(args, target, drafter, modes, prompt_sets, bastion_controller, max_new, out) -> int:
    """`--concurrency`: every mode at every level through the batching scheduler (bastion/concurrency.py)."""
    from bastion.concurrency import markdown, run_concurrency
    from bench.modes import build_modes
    from bench.runner import chat_encoder
    from engine.engine import Engine, make_controller
    from engine.sampling import SamplingParams

    engines = {}
    built = build_modes([m for m in modes if m != "serial-ar"], target, drafter, bastion_controller)
    by_name = {m.name: m.engine for m in built}
    for m in modes:
        engines[m] = Engine(target, None, make_controller("ar")) if m == "serial-ar" else by_name[m]
    encode = chat_encoder(target)
    prompts = [encode([{"role": "user", "content": rec["prompt"]}]) for recs in prompt_sets.values() for rec in recs]
    params = SamplingParams(temperature=args.temperature, max_tokens=max_new, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    print(f"bastion bench --concurrency {','.join(map(str, args.concurrency))}: {len(prompts)} prompts, "
          f"{args.requests_per_client} requests per client, modes {', '.join(modes)}, out {out}", file=sys.stderr)
    cells = run_concurrency(engines, prompts, list(args.concurrency), args.requests_per_client, params, Path(out),
                            progress=not args.no_progress, repeats=args.repeats)
    print(markdown(cells))
    bad = [c for c in cells if c.mismatches]
    if bad:
        print("bastion bench: outputs differ from serial AR for "
              + ", ".join(f"{c.mode} at k={c.concurrency} ({c.mismatches})" for c in bad), file=sys.stderr)
    return 0
