"""engine.linear.warm_up: every oneDNN linear shape swept once per process, at every row count."""
from __future__ import annotations

import pytest
import torch

from engine import linear as linear_mod
from engine.linear import Linear, mkldnn_packing_available, warm_up


@pytest.fixture(autouse=True)
def fresh_process_memo(monkeypatch):
    monkeypatch.setattr(linear_mod, "_WARMED", set())


class Counting:
    """Wraps a linear and records the row counts it was called with."""

    def __init__(self, lin):
        self.lin, self.rows = lin, []
        self.weight, self.in_features, self.out_features = lin.weight, lin.in_features, lin.out_features
        self.packed = getattr(lin, "packed", False)

    def __call__(self, x):
        self.rows.append(x.shape[0])
        return self.lin(x)


def test_each_onednn_shape_runs_once_at_every_row_count_and_mkl_float32_is_skipped():
    bf16 = [Counting(torch.nn.Linear(32, 16).to(torch.bfloat16)) for _ in range(2)]  # one shape, twice
    other = Counting(torch.nn.Linear(16, 32).to(torch.bfloat16))
    fp32 = Counting(torch.nn.Linear(32, 16))  # MKL runs it without compiling: nothing to warm
    calls = warm_up(bf16 + [other, fp32], max_rows=12)
    assert calls == 24
    assert bf16[0].rows == list(range(1, 13)) and bf16[1].rows == [] and other.rows == list(range(1, 13))
    assert fp32.rows == []
    assert warm_up(bf16 + [other], max_rows=12) == 0  # the kernels are the process's: built once


@pytest.mark.skipif(not mkldnn_packing_available(torch.float32, torch.device("cpu")), reason="no oneDNN packing")
def test_packed_float32_is_warmed_and_a_slow_call_ends_the_sweep():
    packed = Counting(Linear(torch.randn(16, 32), None, packed=True))
    assert warm_up([packed], max_rows=5) == 5 and packed.rows == [1, 2, 3, 4, 5]
    linear_mod._WARMED.clear()
    big = Counting(Linear(torch.randn(16, 32), None, packed=True))
    assert warm_up([big], max_rows=50, stop_s=0.0) == 1 and big.rows == [1]  # every call is "slow"
