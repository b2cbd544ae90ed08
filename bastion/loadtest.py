"""`bastion loadtest`: start a server on loopback in this process and soak it (bench/loadtest.py).

Exit status 0 when every check held (no 5xx, every temperature-0 answer equal to its
reference, every stream complete, bad inputs refused with a 4xx, no slot held at the end,
resident memory growth under --max-rss-growth), 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bastion.settings import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--requests", type=int, default=1000, help="requests to send (default 1000)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--max-running", type=int, default=4, help="sequences the server decodes at once (default 4)")
    p.add_argument("--max-queue", type=int, default=64, help="requests allowed to wait (default 64)")
    p.add_argument("--seed", type=int, default=0, help="request mix seed")
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="largest resident-memory growth allowed from the second hundred requests to the end")


def rss_mb() -> float:
    """This process's resident memory in MB (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(args) -> int:
    from prometheus_client import CollectorRegistry

    from bastion.factory import build_engine
    from bastion.settings import settings_from_args
    from bench.loadtest import run_loadtest
    from server.app import ServerConfig, create_app
    from server.local import LocalServer

    settings = settings_from_args(args)
    if settings.mode is None:
        settings.mode = "ar"  # the server's machinery is under test, not the speedup; no calibration
    app = create_app(lambda: build_engine(settings, max_batch=args.max_running),
                     ServerConfig(max_running=args.max_running, max_queue=args.max_queue, loopback_only=True),
                     CollectorRegistry())
    sched = app.state.scheduler
    with LocalServer(app, ready_timeout=600) as srv:
        report = run_loadtest(srv.url, args.requests, args.clients, args.seed, rss=rss_mb,
                              slots=lambda: (sched.num_running, sched.num_waiting))
    print(report.summary())
    growth = report.rss_growth()
    problems = list(report.problems)
    if report.server_errors:
        problems.append(f"{report.server_errors} server errors")
    if growth is not None and growth > args.max_rss_growth:
        problems.append(f"resident memory grew {100 * growth:.1f} % (limit {100 * args.max_rss_growth:.0f} %)")
    for p in problems[:20]:
        print(f"problem: {p}", file=sys.stderr)
    return 1 if problems else 0
