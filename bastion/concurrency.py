"""Throughput under concurrent clients: each mode served by the real scheduler, batching on.

`bastion bench --concurrency 1,2,4,8` runs, for every mode and every concurrency k, k closed-loop
clients (each sends its next request when the previous one has finished) against an in-process
`server.scheduler.Scheduler` with `max_running = k` (the server's own admission, chunked prefill
and batched steps; no HTTP). `serial-ar` is today's one-at-a-time server: AR with
`max_running = 1`, whatever k. Every client sends the same requests in every cell, so cells compare
the same work. Reported per cell: total output tokens per second (first submit to last finish),
mean per-request TPOT (decode seconds per token after the first) and TTFT, the mean batch size
and tree tokens per forward, and, at temperature 0, how many outputs differ from the serial AR
reference (0 in float32: batching changes no output).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.engine import Engine
from engine.sampling import SamplingParams
from server.scheduler import EngineRequest, Scheduler

#: Modes of the concurrency benchmark by default, in report order.
CONCURRENCY_MODES = ("serial-ar", "ar", "tree-4", "tree-16", "tree-64", "bastion")


@dataclass
class Cell:
    """One (mode, concurrency) measurement. Times in seconds."""

    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tpot_s: float
    ttft_s: float
    mean_batch: float
    nodes_per_forward: float
    mismatches: int
    outputs: dict[int, list[int]] | None = None  # prompt index -> output ids (not written to JSON)
    controller: dict | None = None  # the adaptive controller's snapshot after the cell (None: a fixed mode)
    repeat: int = 0  # which pass over the modes (run_concurrency's repeats)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d.pop("outputs")
        d["tokens_per_s"] = self.tokens_per_s
        return d


def _client_plan(prompts: list[list[int]], clients: int, per_client: int) -> list[list[int]]:
    """Request indices per client: client j sends prompts j, j + k, ... (cycled), per_client of them."""
    return [[(j + i * clients) % len(prompts) for i in range(per_client)] for j in range(clients)]


def run_cell(engine: Engine, mode: str, prompts: list[list[int]], clients: int, per_client: int,
             params: SamplingParams, references: dict[int, list[int]] | None = None,
             max_running: int | None = None, timeout_s: float = 3600.0) -> Cell:
    """Serve `clients` closed-loop clients, each sending `per_client` requests, through a Scheduler
    over `engine` (max_running: default `clients`). Returns the Cell. references: prompt index ->
    expected token ids (temperature 0), counted as mismatches when they differ. Raises
    RuntimeError when a request fails or the cell exceeds timeout_s.
    """
    sched = Scheduler(lambda: engine, max_queue=clients, max_running=max_running or clients)
    sched.start()
    deadline = time.monotonic() + 600
    while not sched.ready.wait(0.05):
        if sched.load_error is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not start: {sched.load_error!r}")
    plan = _client_plan(prompts, clients, per_client)
    finished: list[tuple[int, EngineRequest, list[int]]] = []
    lock = threading.Lock()
    errors: list[str] = []
    forwards_before = engine.accounting.snapshot()

    def client(j: int) -> None:
        for i in plan[j]:
            done = threading.Event()
            tokens: list[int] = []
            holder: list[EngineRequest] = []

            def sink(item, tokens=tokens, done=done, holder=holder):
                req = holder[0]
                req.read += 1  # the client reads every event at once (a stalled reader gets cancelled)
                req.last_read = time.perf_counter()
                ids = getattr(item, "token_ids", None)
                if ids is None:  # a RequestFailed
                    errors.append(str(item))
                    done.set()
                    return
                tokens.extend(ids)
                if item.finish_reason is not None:
                    if item.finish_reason not in ("stop", "length"):
                        errors.append(f"request {req.request_id} finished '{item.finish_reason}'")
                    done.set()

            req = EngineRequest(sched.new_id("bench"), prompts[i], params, sink)
            holder.append(req)
            sched.submit(req)
            if not done.wait(timeout_s):
                errors.append(f"request {req.request_id} timed out")
                return
            with lock:
                finished.append((i, req, tokens))

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    sched.shutdown(5.0)
    if errors:
        raise RuntimeError(f"{mode} at concurrency {clients}: {errors[0]}")
    after = engine.accounting.snapshot()
    n_fwd = after.batch_size.n - forwards_before.batch_size.n
    batch_sum = after.batch_size.total - forwards_before.batch_size.total
    nodes_sum = after.step_nodes.total - forwards_before.step_nodes.total
    tpots, ttfts = [], []
    for _, req, tokens in finished:
        ttfts.append(req.first_token - req.arrival)
        if len(tokens) > 1:
            tpots.append((req.finished - req.first_token) / (len(tokens) - 1))
    mism = sum(1 for i, _, tokens in finished if references is not None and i in references
               and tokens != references[i])
    return Cell(mode=mode, concurrency=clients, requests=len(finished), tokens=sum(len(t) for _, _, t in finished),
                wall_s=wall, tpot_s=statistics.fmean(tpots) if tpots else 0.0,
                ttft_s=statistics.fmean(ttfts) if ttfts else 0.0, mean_batch=batch_sum / n_fwd if n_fwd else 0.0,
                nodes_per_forward=nodes_sum / n_fwd if n_fwd else 0.0, mismatches=mism,
                outputs={i: tokens for i, _, tokens in finished},
                controller=engine.controller.snapshot() if hasattr(engine.controller, "snapshot") else None)


def medians(cells: list[Cell]) -> dict[tuple[str, int], tuple[float, float]]:
    """(mode, concurrency) -> (median tokens/s, median TPOT seconds) over the cell's repeats."""
    groups: dict[tuple[str, int], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.mode, c.concurrency), []).append(c)
    return {key: (statistics.median(c.tokens_per_s for c in cs), statistics.median(c.tpot_s for c in cs))
            for key, cs in groups.items()}


def markdown(cells: list[Cell]) -> str:
    """Tokens/s table (modes x concurrency), with per-request TPOT and the ratio to the best mode;
    with repeats, each figure is the median over them."""
    levels = sorted({c.concurrency for c in cells})
    modes = list(dict.fromkeys(c.mode for c in cells))
    med = medians(cells)
    best = {k: max(tps for (m, kk), (tps, _) in med.items() if kk == k) for k in levels}
    head = "| mode | " + " | ".join(f"k={k} tok/s (TPOT ms, x best)" for k in levels) + " |"
    lines = [head, "|---|" + "---|" * len(levels)]
    for m in modes:
        row = [m]
        for k in levels:
            got = med.get((m, k))
            row.append("-" if got is None else f"{got[0]:.1f} ({1e3 * got[1]:.0f}, {got[0] / best[k]:.2f})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_concurrency(engines: dict[str, Engine], prompts: list[list[int]], levels: list[int], per_client: int,
                    params: SamplingParams, out: Path | None = None, progress: bool = True,
                    repeats: int = 1) -> list[Cell]:
    """Every mode of `engines` (name -> Engine; 'serial-ar' runs with max_running 1) at every
    concurrency level: all modes at the first level, then all at the next, and so on. With
    repeats > 1, each level runs every mode that many times, the order rotated by one mode per
    pass, so a slow phase of the machine does not always hit the same mode (the tables report
    medians). At temperature 0 the outputs of the first AR mode ('serial-ar',
    else 'ar') are the references the others' mismatches count against (the reference mode's
    own cells are checked against its first). A warm-up request per mode runs untimed. With
    `out`, writes concurrency.json and concurrency.md there after every cell.
    Returns the cells. Raises RuntimeError when a request fails.
    """
    import json
    import sys

    refs: dict[int, list[int]] | None = {} if params.greedy else None
    ref_mode = next((m for m in ("serial-ar", "ar") if m in engines), None)
    cells: list[Cell] = []
    warm = SamplingParams(temperature=params.temperature, max_tokens=4, seed=params.seed, ignore_eos=params.ignore_eos)
    for mode, engine in engines.items():
        run_cell(engine, mode, prompts[:1], 1, 1, warm)
    # Level-major: every mode runs at one concurrency before the next, so a machine that slows
    # down over the run slows every mode of a level alike.
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(engines)
    for k in levels:
        for rep in range(repeats):
            for mode in names[rep % len(names):] + names[:rep % len(names)]:
                engine = engines[mode]
                check = refs if refs is not None and (mode != ref_mode or refs) else None
                cell = run_cell(engine, mode, prompts, k, per_client, params, check,
                                max_running=1 if mode == "serial-ar" else k)
                cell.repeat = rep
                if refs is not None and mode == ref_mode:
                    for i, toks in (cell.outputs or {}).items():
                        refs.setdefault(i, toks)
                cells.append(cell)
                if progress:
                    print(f"bench --concurrency: {mode} k={k} (pass {rep + 1}/{repeats}): {cell.tokens_per_s:.1f} "
                          f"tok/s, TPOT {1e3 * cell.tpot_s:.0f} ms, batch {cell.mean_batch:.2f}, "
                          f"{cell.nodes_per_forward:.1f} nodes/forward, {cell.mismatches} mismatches", file=sys.stderr)
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "concurrency.json").write_text(json.dumps([c.to_json() for c in cells], indent=1) + "\n")
                    (out / "concurrency.md").write_text(markdown(cells) + "\n")
    return cells
