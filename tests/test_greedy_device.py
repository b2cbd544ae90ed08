"""Greedy acceptance on the device equals the host reference (accept_greedy) and reads the host once."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from engine.attention import random_tree_parents
from engine.greedy_device import accept_greedy_device
from engine.tree import Tree
from engine.tree_buffers import TreeBufferPool
from engine.kv_cache import KVPool
from reference import accept_greedy

#: Tensor methods that read a value back to the host (a device sync on CUDA).
HOST_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero",
              "masked_select", "unique"}


class CountHostReads(TorchFunctionMode):
    """Records every tensor call that brings a value back to the host."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def make_tree(tokens: list[int], parents: list[int]) -> Tree:
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        if p >= 0:
            depths[i] = depths[p] + 1
    return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                a_hat=1.0, log_scores=torch.zeros(len(tokens)))


def random_case(gen: torch.Generator, n: int, vocab: int, dtype: torch.dtype) -> tuple[Tree, torch.Tensor]:
    """A random tree over a tiny vocabulary (siblings often share a token) and integer logits
    (rows often tie); one random chain is made to match the target so deep paths occur."""
    par = random_tree_parents(n, max_depth=int(torch.randint(1, 16, (1,), generator=gen)), generator=gen)
    tree = make_tree(torch.randint(0, vocab, (n,), generator=gen).tolist(), par.tolist())
    logits = torch.randint(0, 3, (n, vocab), generator=gen).to(dtype)
    node = int(torch.randint(0, n, (1,), generator=gen))
    while node > 0:
        p = int(par[node])
        logits[p, int(tree.tokens[node])] = 3  # argmax at p is node's token unless an earlier 3 ties
        if torch.rand(1, generator=gen) < 0.3:
            logits[p, 0] = 3  # a tie that the first-index rule resolves to token 0
        node = p
    return tree, logits


def test_equals_reference_over_many_random_trees_with_ties_and_duplicate_siblings():
    gen = torch.Generator().manual_seed(0)
    pool = TreeBufferPool("cpu")
    deep = ties = dups = 0
    for case in range(600):
        n = int(torch.randint(1, 90, (1,), generator=gen))
        vocab = int(torch.randint(2, 7, (1,), generator=gen))
        dtype = (torch.float32, torch.bfloat16, torch.float16)[case % 3]
        tree, logits = random_case(gen, n, vocab, dtype)
        ref_path, ref_bonus = accept_greedy(tree, logits)
        got = accept_greedy_device(pool.load(tree, prefix_len=case), logits)
        assert got.path == ref_path and got.bonus == ref_bonus, case
        assert got.index.tolist() == ref_path
        deep += len(ref_path) >= 4
        row_max = logits.float().max(dim=-1, keepdim=True).values
        ties += int(((logits.float() == row_max).sum(-1) > 1).any())
        pairs = set(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]))
        dups += len(pairs) < n - 1
    # The cases exercised what they are meant to.
    assert deep > 100 and ties > 400 and dups > 300, (deep, ties, dups)


def test_tie_resolves_to_the_first_maximal_token():
    # Root's logits tie between tokens 1 and 2; children carry 2 (node 1) and 1 (node 2).
    tree = make_tree([9, 2, 1, 4], [-1, 0, 0, 2])
    logits = torch.zeros(4, 6)
    logits[0, 1] = logits[0, 2] = 5.0
    logits[2, 4] = 1.0
    logits[3, 3] = 1.0
    got = accept_greedy_device(TreeBufferPool("cpu").load(tree, 0), logits)
    assert (got.path, got.bonus) == ([0, 2, 3], 3) == accept_greedy(tree, logits)


def test_duplicate_siblings_take_the_first_child_even_when_a_later_one_goes_deeper():
    # Nodes 1 and 2 both carry token 5 under the root; only node 2's child matches further.
    tree = make_tree([0, 5, 5, 7], [-1, 0, 0, 2])
    logits = torch.zeros(4, 8)
    logits[0, 5] = 1.0
    logits[1, 6] = 1.0
    logits[2, 7] = 1.0
    got = accept_greedy_device(TreeBufferPool("cpu").load(tree, 3), logits)
    assert (got.path, got.bonus) == ([0, 1], 6) == accept_greedy(tree, logits)


def test_single_node_and_rejected_root_children():
    pool = TreeBufferPool("cpu")
    one = make_tree([4], [-1])
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    got = accept_greedy_device(pool.load(one, 10), logits)
    assert (got.path, got.bonus, got.index.tolist()) == ([0], 1, [0])
    tree = make_tree([4, 0, 2], [-1, 0, 0])
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    got = accept_greedy_device(pool.load(tree, 10), logits)
    assert (got.path, got.bonus) == ([0], 1) == accept_greedy(tree, logits)


def test_one_host_read_per_acceptance():
    gen = torch.Generator().manual_seed(1)
    pool = TreeBufferPool("cpu")
    for n in (2, 17, 64):
        tree, logits = random_case(gen, n, 4, torch.float32)
        dt = pool.load(tree, 0)
        dt.ancestors  # built with the tree for verification, before acceptance
        with CountHostReads() as counter:
            accept_greedy_device(dt, logits)
        assert counter.reads == ["tolist"], (n, counter.reads)


def test_compaction_with_the_device_index_equals_the_list_path_without_host_reads():
    gen = torch.Generator().manual_seed(2)
    tree = make_tree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, 3, 1])
    logits = torch.zeros(6, 8)
    logits[0, 2] = logits[2, 3] = logits[3, 4] = logits[4, 7] = 1.0
    c = 7
    acc = accept_greedy_device(TreeBufferPool("cpu").load(tree, c), logits)
    assert acc.path == [0, 2, 3, 4]
    a = KVPool(3, 2, 2, 16, 4)
    a.keys.copy_(torch.randn(a.keys.shape, generator=gen))
    a.values.copy_(torch.randn(a.values.shape, generator=gen))
    b = KVPool(3, 2, 2, 16, 4)
    b.keys.copy_(a.keys)
    b.values.copy_(a.values)
    rows = [*range(c), *(c + p for p in acc.path)]
    want_k, want_v = a.keys[:, 1, :, rows].clone(), a.values[:, 1, :, rows].clone()
    other = a.keys[:, 0].clone()
    a.compact(1, c, acc.path)
    with CountHostReads() as counter:
        b.compact(1, c, acc.path, acc.index)
    assert counter.reads == []
    m = len(rows)
    for pool in (a, b):
        assert torch.equal(pool.keys[:, 1, :, :m], want_k) and torch.equal(pool.values[:, 1, :, :m], want_v)
        assert torch.equal(pool.keys[:, 0], other)  # the other slot is untouched
