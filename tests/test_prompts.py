"""Drafter training prompts: size, mix, determinism and disjointness from every benchmark prompt."""
from __future__ import annotations

from collections import Counter

import pytest

from bench import datasets
from bench.datasets import benchmark_texts, load_dataset
from training import prompts
from training.prompts import (
    normalized_words,
    overlapping_prompts,
    stdlib_entries,
    training_prompts,
    word_spans,
)


@pytest.fixture(scope="module")
def train():
    return training_prompts(5000, seed=0)


def test_at_least_5000_distinct_prompts_with_ids(train):
    assert len(train) == 5000
    assert len({p["id"] for p in train}) == 5000
    assert len({p["prompt"] for p in train}) == 5000
    assert train[0]["id"] == "train/00000" and train[-1]["id"] == "train/04999"
    assert all(set(p) == {"id", "kind", "prompt"} and p["prompt"].strip() for p in train)


def test_kinds_in_sensible_proportions(train):
    counts = Counter(p["kind"] for p in train)
    assert counts == {"chat": 2250, "code": 1750, "math": 1000}
    # shuffled together, not in blocks
    assert Counter(p["kind"] for p in train[:500])["math"] > 50


def test_prompts_are_short_and_diverse(train):
    words = [len(p["prompt"].split()) for p in train]
    assert sum(w < 120 for w in words) / len(words) > 0.95
    assert max(words) < 250
    assert len({" ".join(p["prompt"].split()[:3]) for p in train}) > 300
    code = [p["prompt"] for p in train if p["kind"] == "code"]
    stdlib_based = [c for c in code if any(f"`{m}." in c for m in ("textwrap", "itertools", "statistics", "str"))]
    assert len(stdlib_based) > 50
    assert sum("Python" in c for c in code) > len(code) / 4
    math = [p["prompt"] for p in train if p["kind"] == "math"]
    assert all(any(ch.isdigit() for ch in m) for m in math)


def test_stdlib_material_is_read_from_the_standard_library():
    entries = stdlib_entries()
    assert len(entries) > 300
    by_name = {e.qualname: e for e in entries}
    assert "textwrap.dedent" in by_name and by_name["textwrap.dedent"].signature == "(text)"
    assert by_name["str.upper"].summary == "Return a copy of the string converted to uppercase."


def test_deterministic_given_seed():
    a = training_prompts(600, seed=7)
    assert a == training_prompts(600, seed=7)
    b = training_prompts(600, seed=8)
    assert [p["prompt"] for p in a] != [p["prompt"] for p in b]


def test_no_8_word_overlap_with_any_benchmark_prompt(train):
    bench = benchmark_texts()
    # the project's own sets are always part of the check
    assert len(bench) >= 2 * len(load_dataset("math")) + len(load_dataset("repeat"))
    assert overlapping_prompts(train, bench, span=8) == []
    bench_spans = set().union(*(word_spans(t, 8) for t in bench))
    assert all(bench_spans.isdisjoint(word_spans(p["prompt"], 8)) for p in train)


def test_overlap_checker_detects_planted_overlap():
    bench_prompt = load_dataset("math")[4]["prompt"]  # the garden-bed problem
    assert "garden bed is 9 meters long and 4 meters wide" in bench_prompt
    planted = {"id": "x", "kind": "math", "prompt": "Quick one: A GARDEN bed is 9 meters, long and 4 meters WIDE; how big?"}
    seven = {"id": "y", "kind": "math", "prompt": "A garden bed is 9 meters long, three meters wide."}
    clean = {"id": "z", "kind": "chat", "prompt": "Tell me about tulips."}
    assert overlapping_prompts([clean, planted, seven], [bench_prompt]) == [planted]
    # strings and records with turns both work as benchmark items
    rec = {"prompt": "unrelated", "turns": ["unrelated", "one two three four five six seven eight nine"]}
    assert overlapping_prompts(["zero one two three four five six seven eight"], [rec]) == [
        "zero one two three four five six seven eight"]
    assert overlapping_prompts(["one two three four five six seven"], [rec]) == []


def test_normalisation_lowercases_and_strips_punctuation():
    assert normalized_words("Hello, World! It's `re.sub`...") == ["hello", "world", "its", "resub"]
    assert word_spans("a b c", 2) == {("a", "b"), ("b", "c")}
    assert word_spans("a b", 3) == set()


def test_training_prompts_drop_a_planted_benchmark_prompt():
    base = training_prompts(300, seed=3, benchmark=[])
    victim = base[10]["prompt"]
    assert len(victim.split()) >= 8
    filtered = training_prompts(300, seed=3, benchmark=[victim])
    assert len(filtered) == 300
    assert victim not in {p["prompt"] for p in filtered}
    assert overlapping_prompts(filtered, [victim]) == []


def test_filters_against_own_sets_when_packages_are_missing(monkeypatch):
    def absent(dist, suffix, label):
        raise datasets.DatasetUnavailable(f"{dist} missing")

    monkeypatch.setattr(datasets, "_shipped_file", absent)
    texts = prompts.default_benchmark_texts()
    own = [r["question"] for r in load_dataset("math")] + [r["prompt"] for r in load_dataset("repeat")]
    assert set(own) <= set(texts)
    rows = training_prompts(200, seed=1)
    assert len(rows) == 200 and overlapping_prompts(rows, own) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="n must be >= 0"):
        training_prompts(-1)
    with pytest.raises(ValueError, match="unknown kinds"):
        training_prompts(10, mix={"chat": 1, "poems": 1})
    assert Counter(p["kind"] for p in training_prompts(10, mix={"code": 1, "math": 1})) == {"code": 5, "math": 5}
