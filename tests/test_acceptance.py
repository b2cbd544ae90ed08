"""Acceptance of a batched step's trees: one host read in all, each sequence's outcome equal to
its own acceptance alone, a failing sequence isolated (engine/acceptance.py)."""
from __future__ import annotations

import torch

from engine.acceptance import accept_batch, draw_nodes, walk_drawn
from engine.sampling import SamplingParams, UniformStream, sample_with_uniforms
from engine.tree_buffers import TreeBufferPool
from reference import accept_greedy
from test_greedy_device import CountHostReads, random_case

GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=0.9, top_k=3)


def cases(seed: int, b: int):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(b):
        n = int(torch.randint(2, 40, (1,), generator=gen))
        out.append(random_case(gen, n, 5, torch.float32))
    return out


def test_mixed_batch_reads_the_host_once_and_equals_each_sequence_alone():
    trees_logits = cases(0, 4)
    trees = [t for t, _ in trees_logits]
    logits = [lg for _, lg in trees_logits]
    pools = [TreeBufferPool("cpu") for _ in trees]
    dts = [p.load(t, prefix_len=10 * i) for i, (p, t) in enumerate(zip(pools, trees))]
    params = [GREEDY, SAMPLE, GREEDY, SAMPLE]
    gens = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(6)]
    streams = [None, (UniformStream(gens[1], "cpu"), 0), None, (UniformStream(gens[3], "cpu"), 7)]
    with CountHostReads() as mode:
        got = accept_batch(trees, dts, logits, params, gens, streams)
    # One read of the packed results; the rest are the two sampled trees' host-side walks
    # (Tree.children lists parents and tokens of a tree that lives on the host).
    assert mode.reads == ["tolist"] * (1 + 2 * 2), mode.reads
    for r in (0, 2):
        assert (got[r].path, got[r].bonus) == accept_greedy(trees[r], logits[r])
        assert got[r].index.tolist() == got[r].path
    for r, seed, pos in ((1, 5, 0), (3, 6, 7)):
        u = UniformStream(torch.Generator().manual_seed(seed), "cpu").take(pos, dts[r].max_depth + 1)
        draws = draw_nodes(logits[r], params[r], u[trees[r].depths]).tolist()
        assert (got[r].path, got[r].bonus) == walk_drawn(trees[r], draws)
        assert got[r].index is None


def test_lazy_walk_without_draw_all_equals_the_verifier_walk():
    (tree, logits), = cases(1, 1)
    dt = TreeBufferPool("cpu").load(tree, 0)
    from engine.verifier import accept_sample

    got = accept_batch([tree], [dt], [logits], [SAMPLE], [torch.Generator().manual_seed(3)], [None])[0]
    assert (got.path, got.bonus) == accept_sample(tree, logits, SAMPLE, torch.Generator().manual_seed(3))


def test_a_failing_sequence_gets_its_error_and_the_others_their_acceptance():
    (t0, l0), (t1, l1), (t2, l2) = cases(2, 3)
    dts = [TreeBufferPool("cpu").load(t, 0) for t in (t0, t1, t2)]
    bad = (UniformStream(None, "cpu"), -1)  # a negative position: the stream refuses it
    got = accept_batch([t0, t1, t2], dts, [l0, l1, l2], [GREEDY, SAMPLE, GREEDY], [None, None, None],
                       [None, bad, None])
    assert isinstance(got[1], Exception)
    assert (got[0].path, got[0].bonus) == accept_greedy(t0, l0)
    assert (got[2].path, got[2].bonus) == accept_greedy(t2, l2)


def test_walk_drawn_descends_while_a_child_carries_the_nodes_sample():
    from test_greedy_device import make_tree

    tree = make_tree([9, 1, 2, 3, 1], [-1, 0, 0, 1, 3])  # 0 -> {1: tok 1, 2: tok 2}; 1 -> 3 (tok 3); 3 -> 4 (tok 1)
    assert walk_drawn(tree, [1, 3, 0, 1, 4]) == ([0, 1, 3, 4], 4)
    assert walk_drawn(tree, [2, 0, 7, 0, 0]) == ([0, 2], 7)
    assert walk_drawn(tree, [5, 0, 0, 0, 0]) == ([0], 5)


def test_uniform_stream_depends_only_on_the_position():
    a, b = UniformStream(torch.Generator().manual_seed(1), "cpu"), UniformStream(torch.Generator().manual_seed(1), "cpu")
    whole = a.take(0, 600)
    parts = torch.cat([b.take(0, 3), b.take(3, 250), b.take(253, 347)])
    assert torch.equal(whole, parts) and bool(((whole >= 0) & (whole < 1)).all())
    assert torch.equal(b.take(10, 5), whole[10:15])  # re-reading a position gives the same value


def test_inverse_cdf_sampling_follows_the_probabilities_and_skips_zero_mass():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 4)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999])
    assert sample_with_uniforms(probs, u).tolist() == [1, 1, 3, 3]
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6), 0)
    x = sample_with_uniforms(p.expand(20000, 6), torch.rand(20000, generator=gen))
    freq = torch.bincount(x, minlength=6).float() / 20000
    assert torch.allclose(freq, p, atol=0.015)
