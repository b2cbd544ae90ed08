"""The `bastion` command line: generate, serve, calibrate, bench, train-drafter, loadtest."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from bastion.settings import add_engine_arguments

# Subcommand -> module providing add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "generate": ("bastion.cli", "generate text for one prompt"),
    "serve": ("bastion.serve", "run the OpenAI-compatible HTTP server"),
    "calibrate": ("bastion.calibrate", "calibrate the verification latency model on this machine"),
    "bench": ("bastion.bench", "benchmark decoding modes side by side"),
    "train-drafter": ("bastion.train_drafter", "train a DFlash drafter for a target"),
    "loadtest": ("bastion.loadtest", "soak a loopback server with concurrent, cancelled and bad requests"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `bastion generate` (kept stable: scripts depend on them)."""
    p.add_argument("prompt", help="user message, sent through the target's chat template")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args) -> int:
    """`bastion generate`: stream the text to stdout, then a summary line on stderr (or one JSON object)."""
    from bastion.factory import build_engine
    from bastion.settings import settings_from_args
    from engine.sampling import SamplingParams

    engine = build_engine(settings_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, stop=args.stop, seed=args.seed,
    )
    ids = engine.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    if args.json:
        r = engine.generate(ids, params)
        print(json.dumps({
            "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
            "steps": len(r.steps), "tau": round(r.tau, 4),
            "tokens_per_s": round(len(r.token_ids) / r.decode_s, 3) if r.decode_s > 0 else None,
            "mean_tree_size": round(r.mean_tree_size, 3), "ttft_s": round(r.ttft_s, 4),
        }))
        return 0
    import time

    t0 = time.perf_counter()
    n, steps, accepted, t_first = 0, 0, 0, None
    for ev in engine.stream(ids, params):
        if t_first is None:
            t_first = time.perf_counter()
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        n += len(ev.token_ids)
        if ev.step is not None:
            steps += 1
            accepted += ev.step.accepted
        if ev.finish_reason:
            finish = ev.finish_reason
    dt = time.perf_counter() - (t_first or t0)
    sys.stdout.write("\n")
    tau = accepted / steps if steps else 0.0
    print(f"[{n} tokens, {n / dt if dt > 0 else 0:.1f} tokens/s decode, tau {tau:.2f}, "
          f"{steps} steps, finish {finish}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `bastion` console script."""
    parser = argparse.ArgumentParser(prog="bastion", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (modname, help_) in COMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:  # a command whose optional dependencies are missing
            if modname.split(".")[0] in str(e):
                continue
            raise
        modules[name] = mod
        mod.add_arguments(sub.add_parser(name, help=help_, description=help_))
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return modules[args.command].run(args)
    except (ValueError, OSError) as e:
        print(f"bastion {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
