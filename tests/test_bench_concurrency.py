"""`bastion bench --concurrency`: closed-loop clients against the batching scheduler (bastion/concurrency.py)."""
from __future__ import annotations

import json

import pytest

from bastion.concurrency import _client_plan, markdown, medians, run_concurrency
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from helpers import ShuffledMarginalsDrafter, tiny_target

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2], [3, 3], [5, 1, 6]]


def test_client_plan_spreads_prompts_over_clients():
    assert _client_plan(PROMPTS, 2, 3) == [[0, 2, 4], [1, 3, 0]]
    assert _client_plan(PROMPTS, 1, 2) == [[0, 1]]


def test_every_mode_and_level_serves_the_same_outputs_and_batches(tmp_path):
    target = tiny_target(vocab=8, layers=2, hidden=32)
    drafter = ShuffledMarginalsDrafter(8)
    engines = {"serial-ar": Engine(target, None, make_controller("ar")),
               "ar": Engine(target, None, make_controller("ar")),
               "tree-8": Engine(target, drafter, make_controller("tree", 8))}
    cells = run_concurrency(engines, PROMPTS, [1, 3], 2, SamplingParams(max_tokens=12), out=tmp_path, progress=False)
    assert [(c.mode, c.concurrency) for c in cells] == [(m, k) for k in (1, 3) for m in engines]  # level-major
    for c in cells:
        assert c.mismatches == 0 and c.requests == 2 * c.concurrency and c.tokens == 12 * c.requests
        assert c.tokens_per_s > 0 and c.tpot_s > 0 and c.ttft_s > 0
    by = {(c.mode, c.concurrency): c for c in cells}
    assert by[("serial-ar", 3)].mean_batch == 1.0  # today's server: one at a time
    assert by[("ar", 3)].mean_batch > 1.5  # batched: several sequences per forward
    assert by[("tree-8", 3)].nodes_per_forward > by[("ar", 3)].nodes_per_forward
    saved = json.loads((tmp_path / "concurrency.json").read_text())
    assert len(saved) == 6 and "outputs" not in saved[0]
    table = markdown(cells)
    assert table.count("\n") == 2 + len(engines) - 1 and "k=3" in table


def test_repeats_rotate_the_mode_order_and_the_table_reports_medians():
    target = tiny_target(vocab=8, layers=2, hidden=32)
    engines = {"ar": Engine(target, None, make_controller("ar")),
               "tree-8": Engine(target, ShuffledMarginalsDrafter(8), make_controller("tree", 8)),
               "chain": Engine(target, ShuffledMarginalsDrafter(8), make_controller("chain"))}
    cells = run_concurrency(engines, PROMPTS, [2], 1, SamplingParams(max_tokens=6), progress=False, repeats=3)
    assert [(c.mode, c.repeat) for c in cells] == [("ar", 0), ("tree-8", 0), ("chain", 0), ("tree-8", 1),
                                                   ("chain", 1), ("ar", 1), ("chain", 2), ("ar", 2), ("tree-8", 2)]
    assert all(c.mismatches == 0 for c in cells)
    med = medians(cells)
    for mode in engines:
        runs = sorted(c.tokens_per_s for c in cells if c.mode == mode)
        assert med[(mode, 2)][0] == runs[1]
    best = max(v[0] for v in med.values())
    assert f"{med[('chain', 2)][0]:.1f} ({1e3 * med[('chain', 2)][1]:.0f}, {med[('chain', 2)][0] / best:.2f})" \
        in markdown(cells)
    with pytest.raises(ValueError):
        run_concurrency(engines, PROMPTS, [2], 1, SamplingParams(max_tokens=6), progress=False, repeats=0)


def test_a_wrong_output_is_counted_as_a_mismatch():
    target = tiny_target(vocab=8, layers=2, hidden=32)
    other = tiny_target(vocab=8, layers=2, hidden=32, seed=1)  # a different model: different outputs
    engines = {"ar": Engine(target, None, make_controller("ar")), "tree-4": Engine(other, None, make_controller("ar"))}
    cells = run_concurrency(engines, PROMPTS[:2], [2], 1, SamplingParams(max_tokens=8), progress=False)
    assert cells[0].mismatches == 0 and cells[1].mismatches > 0


def test_the_cli_refuses_bad_levels():
    from bastion.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "1,x"])
