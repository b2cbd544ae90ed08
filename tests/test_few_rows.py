"""Few-row steps: linears on zero-padded rows (engine.linear) and grouped-query heads stacked as
rows (engine.attention), each where measured faster, with the values of the plain computation."""
from __future__ import annotations

import pytest
import torch

from engine import linear as linear_mod
import torch.nn.functional as F

from engine.attention import TreeAttention, choose_gqa_packing, packed_gqa_attention
from engine.forward import Segment, TargetForward
from engine.linear import Linear, choose_row_padding, mkldnn_packing_available
from helpers import tiny_target

PACKING = [False] + ([True] if mkldnn_packing_available(torch.float32, torch.device("cpu")) else [])


@pytest.mark.parametrize("packed", PACKING)
def test_padded_rows_give_the_unpadded_values_in_the_input_shape(packed):
    torch.manual_seed(0)
    w, b = torch.randn(24, 16), torch.randn(24)
    plain, padded = Linear(w, b, packed), Linear(w, b, packed)
    padded.row_padding = {1: 4, 2: 4, 3: 5}
    for m in (1, 2, 3, 6):
        x = torch.randn(m, 16)
        y = padded(x)
        assert y.shape == (m, 24)
        torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, x @ w.T + b, rtol=1e-4, atol=1e-4)
    x3 = torch.randn(2, 1, 16)  # not a 2-D row block: left as it is
    assert padded(x3).shape == (2, 1, 24)


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Costed(Linear):
    """A linear whose product advances a synthetic clock by cost[rows] seconds."""

    def __init__(self, clock: _Clock, cost: dict[int, float]):
        super().__init__(torch.zeros(8, 4))
        self.clock, self.cost, self.calls = clock, cost, []

    def _product(self, x):
        self.clock.t += self.cost[x.shape[0]]
        self.calls.append(x.shape[0])
        return super()._product(x)


def test_plan_pads_only_where_a_larger_row_count_is_clearly_cheaper(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(linear_mod.time, "perf_counter", clock)
    # The EPYC shape of the packed float32 stack: one and two rows slow, three to six fast.
    cost = {1: 4.0, 2: 4.2, 3: 2.0, 4: 1.9, 5: 1.95, 6: 3.0, 7: 3.2, 8: 3.3}
    lins = [_Costed(clock, cost) for _ in range(3)]
    plan = choose_row_padding(lins, max_rows=8, repeats=3, margin=0.92)
    # 1 and 2 go to the cheapest larger count (4); 3 -> 4 saves 5 %, under the margin; 6..8 have
    # nothing cheaper at or above them.
    assert plan == {1: 4, 2: 4}
    assert sorted(set(lins[0].calls)) == list(range(1, 9)) and len(lins[0].calls) == 8 * 4
    assert choose_row_padding(lins, max_rows=8, repeats=3, margin=0.99) == {1: 4, 2: 4, 3: 4}
    assert choose_row_padding([]) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_packed_gqa_attention_equals_sdpa_with_grouped_heads(dtype, rows):
    torch.manual_seed(rows)
    c = 37
    q = torch.randn(rows, 6, 16).to(dtype).transpose(0, 1)[None]  # [1, hq, s, d] as the forward passes it
    k, v = torch.randn(1, 2, c + rows, 16).to(dtype), torch.randn(1, 2, c + rows, 16).to(dtype)
    parents = torch.arange(rows) - 1
    if rows > 2:
        parents[2] = 0  # a branch: node 2 does not see node 1
    mask = TreeAttention.from_parents(parents, c, "cpu").visible()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for m in (mask, None):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.25, enable_gqa=True)
        got = packed_gqa_attention(q, k, v, 0.25, m)
        assert got.shape == ref.shape == (1, 6, rows, 16)
        torch.testing.assert_close(got, ref, **tol)
    with pytest.raises(ValueError, match="do not group"):
        packed_gqa_attention(torch.randn(1, 5, 1, 16), k, v, 0.25)


def test_gqa_packing_is_never_chosen_without_groups_or_off_the_cpu():
    assert choose_gqa_packing(torch.float32, 4, 4, 16) == frozenset()
    assert choose_gqa_packing(torch.float32, 6, 4, 16) == frozenset()
    assert choose_gqa_packing(torch.float32, 6, 2, 16, device="meta") == frozenset()
    assert choose_gqa_packing(torch.float32, 6, 2, 16, max_rows=3, repeats=2) <= {1, 2, 3}


def test_forward_with_padding_and_packed_heads_equals_the_forward_without():
    model = tiny_target(vocab=16).model
    fwd_plain = TargetForward(model, row_padding={}, gqa_packing=set())
    fwd_fast = TargetForward(model, packed=fwd_plain.packed, row_padding={1: 4, 2: 4}, gqa_packing={1, 2, 3})
    assert fwd_fast.row_padding == {1: 4, 2: 4} and fwd_fast.lm_head.row_padding == {1: 4, 2: 4}
    ids = torch.tensor([5, 9, 2, 7, 11, 3, 8])
    tree = TreeAttention.from_parents(torch.tensor([-1, 0, 0]), 6, "cpu")
    outs = []
    for fwd in (fwd_plain, fwd_fast):
        pool = fwd.new_pool(1, 64)
        fwd(pool, ids[:3], torch.arange(3), [Segment(0, 0, 3)])  # a first chunk: causal, no cache
        chunk, _ = fwd(pool, ids[3:5], torch.arange(3, 5), [Segment(0, 3, 2)])  # two rows after a cache
        one, _ = fwd(pool, ids[5:6], torch.tensor([5]), [Segment(0, 5, 1)])  # the one-token step
        tree_logits, _ = fwd(pool, ids[4:7], torch.tensor([6, 7, 7]), [Segment(0, 6, 3, tree)])
        outs.append(torch.cat([chunk, one, tree_logits]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
