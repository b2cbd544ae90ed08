"""The benchmark loop: load prompt sets, warm up, run every mode on every prompt interleaved, save as it goes.

Interleaving (prompt 1: A B C, prompt 2: A B C, ...) spreads machine drift over all
modes. After each prompt, DIR/results.json is rewritten (atomically) with every record
so far; a later run with the same measurement settings resumes from it and only runs
the (prompt, mode) pairs it lacks. At the end the summary, report.md and plot.png are
written from all records of the selected prompts and modes.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import platform
import shlex
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import report
from bench.datasets import DatasetUnavailable, load_dataset, load_prompts_file
from bench.modes import Encoder, Mode
from engine.engine import ContextLengthError
from engine.loader import Target
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)

RESULTS = "results.json"
REPORT = "report.md"
PLOT = "plot.png"
FORMAT_VERSION = 1
#: Settings that define a measurement: a resumed run must match them all.
MEASUREMENT_KEYS = ("target", "drafter", "dtype", "device", "max_new_tokens", "temperature", "seed", "multi_turn",
                    "ignore_eos")
WARMUP_TOKENS = 8


class ResumeMismatch(ValueError):
    """DIR/results.json was made with other measurement settings."""


@dataclass
class BenchSettings:
    """What one benchmark run measures. modes: expanded names (see bench.modes.expand_modes)."""

    target: str
    drafter: str
    dtype: str
    device: str
    modes: list[str]
    datasets: list[str] = field(default_factory=list)
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    multi_turn: bool = False
    ignore_eos: bool = False
    num_prompts: int | None = None
    budgets: list[int] = field(default_factory=list)
    #: Passes over every prompt and mode; times and speedups are then medians over passes
    #: (bench.report.summarize). Not a measurement key: a resumed run with more adds passes.
    repeats: int = 1

    def to_json(self) -> dict:
        return dict(self.__dict__)


# ---- prompts ------------------------------------------------------------------------------

def load_prompt_sets(names: list[str], files: list[str], num_prompts: int | None
                     ) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """({dataset name: records}, {dataset name: why it was skipped}).

    names: bench.datasets names; files: JSONL prompt files, each a dataset named after the
    file's stem. A set whose package is missing is skipped with the installer's hint;
    a bad name or file raises (ValueError / FileNotFoundError / PromptFileError).
    """
    sets: dict[str, list[dict]] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            sets[name] = load_dataset(name, num_prompts)
        except DatasetUnavailable as e:
            skipped[name] = str(e)
    for f in files:
        name = Path(f).stem
        if name in sets:
            raise ValueError(f"prompt file '{f}' names dataset '{name}', which is already selected")
        sets[name] = load_prompts_file(f, num_prompts)
    return sets, skipped


def chat_encoder(target: Target) -> Encoder:
    """messages -> prompt ids through the target's chat template (thinking disabled for Qwen3).

    A tokenizer without a chat template gets the turns' text joined by blank lines; a
    tokenizer that cannot encode text at all (test doubles) raises ValueError: pass
    `char_encoder` or your own encoder to `run_bench` instead.
    """
    tok = target.tokenizer
    if getattr(tok, "chat_template", None):
        def encode(messages: list[dict]) -> list[int]:
            out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                          enable_thinking=False)
            return list(out["input_ids"])
        return encode
    if hasattr(tok, "encode"):
        return lambda messages: list(tok.encode("\n\n".join(m["content"] for m in messages)))
    raise ValueError(f"the tokenizer of target '{target.name}' has no chat template and cannot encode text; "
                     "give the benchmark an encoder (bench.runner.char_encoder for test targets)")


def char_encoder(vocab: int, max_len: int = 48) -> Encoder:
    """Plain prompt ids for targets without a real tokenizer: each character's code point mod vocab.

    Keeps the last max_len ids so tiny targets with short contexts fit.
    """
    def encode(messages: list[dict]) -> list[int]:
        text = "\n\n".join(m["content"] for m in messages)
        return [ord(c) % vocab for c in text][-max_len:]
    return encode


def prompt_seed(seed: int, dataset: str, prompt_id: str) -> int:
    """The sampling seed of one prompt: the same for every mode, different per prompt."""
    return (seed * 1_000_003 + zlib.crc32(f"{dataset}/{prompt_id}".encode())) % (2 ** 31)


# ---- environment ------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(target: Target, drafter: str, device: str, calibration: dict | None = None) -> dict:
    """Hardware, versions and what was loaded, for results.json."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.device(device).type == "cuda" and torch.cuda.is_available() else None
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": device,
        "target": target.name,
        "target_params": sum(p.numel() for p in target.model.parameters()),
        "drafter": drafter,
        "calibration": calibration,
        "command": " ".join(shlex.quote(a) for a in ["bastion", *sys.argv[1:]]) if sys.argv else None,
    }


# ---- results file -----------------------------------------------------------------------------

def load_results(path: Path, settings: BenchSettings) -> list[dict]:
    """Records of an earlier run at `path` (none if the file is absent).

    Raises ResumeMismatch naming the settings that differ, ValueError for an unreadable file.
    """
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); move it away or pass --fresh") from None
    prev = old.get("settings") or {}
    now = settings.to_json()
    diff = [f"{k}: {prev.get(k)!r} there, {now[k]!r} now" for k in MEASUREMENT_KEYS if prev.get(k) != now[k]]
    if diff:
        raise ResumeMismatch(f"{path} was made with other settings ({'; '.join(diff)}); "
                             "use another --out or pass --fresh to start over")
    return list(old.get("records") or [])


def write_json(path: Path, obj: dict) -> None:
    """Write atomically; each record on one line so the file stays readable and diffable."""
    parts = []
    for k, v in obj.items():
        if k == "records":
            body = "[\n" + ",\n".join("  " + json.dumps(r) for r in v) + "\n]" if v else "[]"
        else:
            body = json.dumps(v, indent=2)
        parts.append(f"{json.dumps(k)}: {body}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    os.replace(tmp, path)


# ---- the loop -----------------------------------------------------------------------------------

def _params(settings: BenchSettings, seed: int | None, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=settings.temperature, max_tokens=max_tokens or settings.max_new_tokens,
                          seed=seed, ignore_eos=settings.ignore_eos)


def _turns(rec: dict, multi_turn: bool) -> list[str]:
    return list(rec.get("turns") or [rec["prompt"]]) if multi_turn else [rec["prompt"]]


def run_bench(settings: BenchSettings, target: Target, modes: list[Mode], prompt_sets: dict[str, list[dict]],
              out_dir: Path | str, *, encode: Encoder | None = None, env: dict | None = None,
              skipped: dict | None = None, fresh: bool = False, warmup: bool = True, progress: bool = True,
              plot: bool = True) -> dict:
    """Run every mode on every prompt, interleaved, resuming from out_dir/results.json.

    The order of the modes rotates by one from prompt to prompt (prompt i starts with mode
    i mod M), so that no mode always runs first or last in a prompt's cycle: on a machine whose
    speed drifts (measured here: up to 80 % within an hour) a fixed order hands one mode the drift.
    With settings.repeats = R > 1 the whole sequence runs R times (pass p starts prompt i with
    mode (i + p) mod M); each record carries its `repeat`, and the summary's times and speedups
    are medians over passes (bench.report.summarize).

    settings.modes must name `modes` in order; settings.datasets is set from prompt_sets.
    encode: messages -> prompt ids (default chat_encoder(target)). env: environment dict
    (default `environment(...)`). skipped: {"modes": {...}, "datasets": {...}} reasons to record.
    Returns the results dict also written to results.json (with report.md and plot.png).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings.datasets = list(prompt_sets)
    if [m.name for m in modes] != settings.modes:
        raise ValueError(f"settings.modes {settings.modes} do not name the modes given {[m.name for m in modes]}")
    encode = encode or chat_encoder(target)
    env = env or environment(target, settings.drafter, settings.device)
    skipped = {"modes": dict((skipped or {}).get("modes") or {}),
               "datasets": dict((skipped or {}).get("datasets") or {}), "prompts": {}}
    path = out / RESULTS
    records = [] if fresh else load_results(path, settings)
    if settings.repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {settings.repeats}")
    done = {(r["dataset"], r["prompt_id"], r["mode"], r.get("repeat", 0)) for r in records}
    started = _dt.datetime.now().isoformat(timespec="seconds")

    # Prompts that cannot fit the target's context are left out of every mode.
    todo: list[tuple[str, dict, list[str]]] = []
    for ds, recs in prompt_sets.items():
        for rec in recs:
            turns = _turns(rec, settings.multi_turn)
            n = len(encode([{"role": "user", "content": turns[0]}]))
            if n + settings.max_new_tokens > target.max_context:
                skipped["prompts"][f"{ds}/{rec['id']}"] = (f"prompt of {n} tokens + {settings.max_new_tokens} new "
                                                            f"tokens exceeds the context of {target.max_context}")
                continue
            todo.append((ds, rec, turns))
    pending = sum(1 for rep in range(settings.repeats) for ds, rec, _ in todo for m in modes
                  if (ds, rec["id"], m.name, rep) not in done)

    def results(status: str) -> dict:
        keep = {(ds, rec["id"]) for ds, rec, _ in todo}
        sel = [r for r in records if (r["dataset"], r["prompt_id"]) in keep and r["mode"] in settings.modes]
        summary = report.summarize(sel, settings.datasets, settings.modes, settings.temperature == 0.0)
        return {
            "version": FORMAT_VERSION, "status": status, "started": started,
            "updated": _dt.datetime.now().isoformat(timespec="seconds"),
            "settings": settings.to_json(), "environment": env, "skipped": skipped,
            "summary": summary, "records": records, "controllers": controllers(),
        }

    def controllers() -> dict:
        # Adaptive modes: their controller's state over this process's part of the run.
        out = {}
        for m in modes:
            snap = getattr(m, "controller_snapshot", None)
            if callable(snap) and (val := snap()) is not None:
                out[m.name] = val
        return out

    if pending and warmup and todo:
        _warm_up(modes, todo[0][2][:1], encode, settings)

    bar = _progress(pending, progress)
    try:
        for rep, i, (ds, rec, turns) in ((rep, i, t) for rep in range(settings.repeats) for i, t in enumerate(todo)):
            if f"{ds}/{rec['id']}" in skipped["prompts"]:
                continue
            new = False
            k = (i + rep) % len(modes)
            for mode in modes[k:] + modes[:k]:
                if (ds, rec["id"], mode.name, rep) in done:
                    continue
                seed = prompt_seed(settings.seed, ds, rec["id"])
                try:
                    m = mode.run(turns, encode, _params(settings, seed))
                except ContextLengthError as e:  # a later turn outgrew the context
                    skipped["prompts"][f"{ds}/{rec['id']}"] = str(e)
                    records[:] = [r for r in records if (r["dataset"], r["prompt_id"]) != (ds, rec["id"])]
                    break
                records.append({"dataset": ds, "prompt_id": rec["id"], "kind": rec.get("kind"), "mode": mode.name,
                                "seed": seed, "repeat": rep, **m.to_json()})
                done.add((ds, rec["id"], mode.name, rep))
                new = True
                if bar is not None:
                    bar.update(1)
                    sp = report.running_speedups(records, settings.modes)
                    bar.set_postfix_str(" ".join(f"{k} {v:.2f}x" for k, v in sp.items()), refresh=False)
            if new:
                write_json(path, results("partial"))
    finally:
        if bar is not None:
            bar.close()
    todo = [t for t in todo if f"{t[0]}/{t[1]['id']}" not in skipped["prompts"]]
    res = results("complete")
    write_json(path, res)
    (out / REPORT).write_text(report.markdown_report(res))
    if plot:
        report.plot(res["summary"], settings.datasets, settings.modes, out / PLOT)
    return res


def _warm_up(modes: list[Mode], turns: list[str], encode: Encoder, settings: BenchSettings) -> None:
    """One short untimed generation per mode (allocations, kernels, controller start)."""
    for mode in modes:
        mode.run(turns, encode, _params(settings, settings.seed, min(WARMUP_TOKENS, settings.max_new_tokens)))


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)
