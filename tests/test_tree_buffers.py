"""Per-bucket tree buffers: bucket sizes, contents, reuse across steps, masks built from them."""
from __future__ import annotations

import pytest
import torch

from drafting.proposal import Marginals
from engine.attention import random_tree_parents
from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from engine.tree import FixedBudgetPolicy, Tree, build_tree
from reference import ancestor_matrix, tree_attention_mask
from engine.tree_buffers import TreeBufferPool, TreeBuffers, bucket_capacity
from helpers import OracleDrafter, tiny_target


def random_tree(n: int, seed: int) -> Tree:
    gen = torch.Generator().manual_seed(seed)
    par = random_tree_parents(n, 6, gen)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depths[i] = depths[par[i]] + 1
    return Tree(tokens=torch.randint(0, 1000, (n,), generator=gen), parents=par, depths=depths, a_hat=1.0,
                log_scores=torch.zeros(n))


def test_bucket_capacity():
    assert [bucket_capacity(n) for n in (1, 15, 16, 17, 33, 64, 65, 1000)] == [16, 16, 16, 32, 64, 64, 128, 1024]
    assert bucket_capacity(3, minimum=1) == 4
    with pytest.raises(ValueError, match="at least one node"):
        bucket_capacity(0)


def test_load_writes_the_tree_and_its_positions():
    tree = random_tree(23, seed=0)
    dt = TreeBuffers(32, "cpu").load(tree, prefix_len=41)
    assert dt.size == 23 and dt.prefix_len == 41 and dt.max_depth == int(tree.depths.max())
    assert torch.equal(dt.tokens, tree.tokens) and torch.equal(dt.parents, tree.parents)
    assert torch.equal(dt.depths, tree.depths)
    assert torch.equal(dt.position_ids, tree.position_ids(41))
    assert torch.equal(dt.ancestors, torch.from_numpy(ancestor_matrix(tree.parents)))
    # The device mask has exactly the values of the host mask it replaces.
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dt.additive_mask(dtype), tree_attention_mask(tree, 41, dtype))
    with pytest.raises(ValueError, match="does not fit"):
        TreeBuffers(16, "cpu").load(tree, 0)


def test_pool_reuses_one_storage_per_bucket():
    pool = TreeBufferPool("cpu")
    a = pool.load(random_tree(20, 1), 5)
    ptr_tokens, ptr_anc = a.tokens.data_ptr(), a.ancestors.data_ptr()
    b = pool.load(random_tree(31, 2), 9)
    assert b.tokens.data_ptr() == ptr_tokens and b.ancestors.data_ptr() == ptr_anc
    tree_c = random_tree(7, 3)
    c = pool.load(tree_c, 0)
    assert pool.capacities == [16, 32] and c.tokens.data_ptr() != ptr_tokens
    # A later load into the same bucket overwrote the earlier views' contents, and the new
    # ancestors are exact although the buffer held a larger tree before.
    d = pool.load(random_tree(9, 4), 0)
    assert d.tokens.data_ptr() == c.tokens.data_ptr()
    assert torch.equal(d.ancestors, torch.from_numpy(ancestor_matrix(random_tree(9, 4).parents)))


def test_engine_steps_reuse_the_same_buffer_storage():
    target = tiny_target(vocab=64, layers=2, hidden=32)
    prompt = [3, 5, 7]
    ref = Engine(target).generate(prompt, SamplingParams(max_tokens=24)).token_ids
    eng = Engine(target, OracleDrafter(prompt + ref + [0] * 16, 64, decoy_every=3), make_controller("tree", 16))
    seen = []
    load = eng.buffers.load

    def recording_load(tree, prefix_len):
        dt = load(tree, prefix_len)
        seen.append((dt.size, dt.tokens.data_ptr(), dt.ancestors.data_ptr()))
        return dt

    eng.buffers.load = recording_load
    got = eng.generate(prompt, SamplingParams(max_tokens=24))
    assert got.token_ids == ref
    assert len(seen) == len(got.steps) >= 3 and all(n <= 16 for n, _, _ in seen)
    assert len({p for _, p, _ in seen}) == 1 and len({p for _, _, p in seen}) == 1
    assert eng.buffers.capacities == [16]


def test_marginals_to_host_on_the_cpu_is_the_same_object_and_build_tree_uses_it():
    ids = torch.tensor([[151935, 7], [3, 151000]])
    lps = torch.tensor([[-0.1, -2.5], [-0.3, -1.25]])
    m = Marginals(ids, lps)
    assert m.to_host() is m
    tree = build_tree(1, m, FixedBudgetPolicy(5), 2)
    assert tree.tokens.tolist() == [1, 151935, 3, 151000, 7]
