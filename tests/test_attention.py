"""Tree attention backends (engine.attention): every backend agrees with sdpa over random trees,
prefix lengths 0..2048 and GQA shapes of Qwen3-8B / Llama-3.1-8B scaled down; the log-sum-exp merge
behind flash_attn is exact; the engine's own forward runs every backend and equals transformers with a dense mask."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import engine.attention as attn
from engine.attention import (
    TreeAttention,
    ancestor_matrix_device,
    attention_lse,
    available_backends,
    merge_attention,
    random_tree_parents,
    select_backend,
    split_tree_attention,
    torch_prefix_attention,
)
from engine.tree import Tree
from engine.forward import Segment, TargetForward
from reference import ancestor_matrix, hf_forward, reference_tree_attention, tree_attention_mask

# (n_q, n_kv, head_dim): Qwen3-8B and Llama-3.1-8B are both 32 q / 8 kv heads of 128; scaled head dims.
SHAPES = {"qwen3-8b/8": (32, 8, 16), "llama3.1-8b/2": (32, 8, 64)}
# (tree nodes n, prefix c) per shape: together they cover prefixes 0..2048, block edges and n > one block.
CASES = {"qwen3-8b/8": ((1, 0), (64, 127), (33, 2048)), "llama3.1-8b/2": ((9, 1), (130, 300), (20, 2048))}


def _case(n: int, c: int, shape, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n_q, n_kv, d = shape
    q = torch.randn(1, n_q, n, d, generator=g).to(dtype)
    k = torch.randn(1, n_kv, c + n, d, generator=g).to(dtype)
    v = torch.randn(1, n_kv, c + n, d, generator=g).to(dtype)
    tree = TreeAttention.from_parents(random_tree_parents(n, generator=g), c, "cpu")
    return q, k, v, tree


def _run(backend: str, q, k, v, tree, scale):
    return attn.tree_attention(backend, q, k, v, tree, scale)


def test_ancestor_matrix_on_device_equals_host_version():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 17, 64, 200):
        par = random_tree_parents(n, generator=g)
        depth_bound = n - 1
        assert (ancestor_matrix_device(par, depth_bound, "cpu").numpy() == ancestor_matrix(par)).all()
    chain = torch.arange(16) - 1
    assert ancestor_matrix_device(chain, 15, "cpu").equal(torch.ones(16, 16, dtype=torch.bool).tril())


def test_tree_visibility_equals_the_engine_mask():
    g = torch.Generator().manual_seed(1)
    par = random_tree_parents(40, generator=g)
    depths = torch.zeros(40, dtype=torch.long)
    for i in range(1, 40):
        depths[i] = depths[par[i]] + 1
    tree = Tree(tokens=torch.zeros(40, dtype=torch.long), parents=par, depths=depths, a_hat=1.0,
                log_scores=torch.zeros(40))
    ta = TreeAttention.from_tree(tree, 33, "cpu")
    additive = tree_attention_mask(tree, 33, torch.float32)
    assert ta.visible().equal(additive == 0)


@pytest.mark.parametrize("name", list(SHAPES))
def test_backends_agree_with_sdpa_over_random_trees_and_prefixes(name):
    shape = SHAPES[name]
    scale = shape[2] ** -0.5
    for i, (n, c) in enumerate(CASES[name]):
        q, k, v, tree = _case(n, c, shape, seed=10 * i + shape[2])
        ref = reference_tree_attention(q, k, v, tree, scale)
        sdpa = _run("sdpa", q, k, v, tree, scale)
        assert torch.allclose(sdpa, ref, atol=1e-5), ("sdpa", n, c)
        for backend in ("flex", "flash_attn"):
            if backend == "flash_attn":
                # The flash_attn backend on CPU: the same code with the pure-torch prefix stand-in.
                got = split_tree_attention(q, k, v, tree, scale, torch_prefix_attention)
            else:
                got = _run(backend, q, k, v, tree, scale)
            assert torch.allclose(got, sdpa, atol=1e-5), (backend, n, c, (got - sdpa).abs().max())


def test_flex_agrees_in_bfloat16():
    q, k, v, tree = _case(48, 700, (32, 8, 64), seed=3, dtype=torch.bfloat16)
    sdpa = _run("sdpa", q, k, v, tree, 0.125)
    flex = _run("flex", q, k, v, tree, 0.125)
    ref = reference_tree_attention(q, k, v, tree, 0.125)
    assert (flex.float() - ref.float()).abs().max() < 2e-2
    assert (flex.float() - sdpa.float()).abs().max() < 2e-2


def test_block_mask_skips_invisible_blocks_and_marks_prefix_blocks_full():
    # A 300-node chain of depth 1 (all children of the root) over 256 prefix tokens, blocks of 128.
    par = torch.zeros(300, dtype=torch.long)
    par[0] = -1
    tree = TreeAttention.from_parents(par, 256, "cpu", max_depth=1)
    bm = tree.block_mask(128)
    full = bm.full_kv_num_blocks.flatten().tolist()
    partial = bm.kv_num_blocks.flatten().tolist()
    # Two prefix blocks are full for every q block; each q block only touches the root's block
    # and its own diagonal block of the tree part, never the others.
    assert full == [2, 2, 2]
    assert partial == [1, 2, 2]


def test_merge_is_exact_for_any_split_of_the_keys():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 7, 32, generator=g)
    k = torch.randn(1, 2, 50, 32, generator=g)
    v = torch.randn(1, 2, 50, 32, generator=g)
    full_out, full_lse = attention_lse(q, k, v, 0.2)
    for cut in (1, 13, 49):
        a = attention_lse(q, k[:, :, :cut], v[:, :, :cut], 0.2)
        b = attention_lse(q, k[:, :, cut:], v[:, :, cut:], 0.2)
        out, lse = merge_attention(*a, *b)
        assert torch.allclose(out, full_out, atol=1e-6)
        assert torch.allclose(lse, full_lse, atol=1e-5)
    # An empty part (lse = -inf) contributes nothing.
    empty_out, empty_lse = torch.zeros_like(full_out), torch.full_like(full_lse, float("-inf"))
    out, lse = merge_attention(empty_out, empty_lse, full_out, full_lse)
    assert torch.allclose(out, full_out) and torch.allclose(lse, full_lse)


def test_split_attention_with_flash_layout_stand_in_matches_full_sdpa():
    """The flash_attn backend's decomposition: a prefix part with its LSE (as flash-attn returns it,
    bf16 output and float32 LSE) and the masked tree part, merged, against one full SDPA call."""
    q, k, v, tree = _case(40, 512, (32, 8, 64), seed=7)

    def flash_like(q_, k_, v_, scale):
        out, lse = torch_prefix_attention(q_, k_, v_, scale)
        return out.to(torch.bfloat16).to(q_.dtype), lse

    got = split_tree_attention(q, k, v, tree, 0.125, flash_like)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=tree.visible(), scale=0.125,
                                                            enable_gqa=True)
    assert (got - full).abs().max() < 1e-2
    exact = split_tree_attention(q, k, v, tree, 0.125)
    assert torch.allclose(exact, full, atol=1e-5)


# ---- inside transformers models --------------------------------------------------------------------

def _tiny(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.eval().requires_grad_(False)


def _random_tree(n: int, seed: int) -> Tree:
    g = torch.Generator().manual_seed(seed)
    par = random_tree_parents(n, generator=g)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depths[i] = depths[par[i]] + 1
    return Tree(tokens=torch.randint(0, 64, (n,), generator=g), parents=par, depths=depths, a_hat=1.0,
                log_scores=torch.zeros(n))


def _hf_verify_logits(model, prompt, tree: Tree):
    """transformers' own forward over the prompt, then the tree with the dense additive mask."""
    cache = DynamicCache(config=model.config)
    c = prompt.shape[1]
    with torch.inference_mode():
        hf_forward(model, prompt, cache)
        out = hf_forward(model, tree.tokens[None], cache, position_ids=tree.position_ids(c),
                         attention_mask=tree_attention_mask(tree, c, model.dtype))
    return out.logits[0]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_every_backend_in_the_engine_forward_equals_transformers_with_a_dense_mask(kind, monkeypatch):
    model = _tiny(kind)
    prompt = torch.randint(0, 64, (1, 37), generator=torch.Generator().manual_seed(2))
    tree = _random_tree(24, seed=4)
    ref = _hf_verify_logits(model, prompt, tree)
    # flash_attn needs CUDA and the package: on CPU its prefix part is the pure-torch stand-in.
    monkeypatch.setattr(attn, "flash_prefix_attention", torch_prefix_attention)
    fwd = TargetForward(model, packed=False)
    c = prompt.shape[1]
    for backend in ("sdpa", "flex", "flash_attn"):
        pool = fwd.new_pool(1, 64)
        fwd(pool, prompt[0], torch.arange(c), [Segment(0, 0, c)], backend=backend)
        got, _ = fwd(pool, tree.tokens, tree.position_ids(c)[0], [Segment(0, c, tree.size,
                     TreeAttention.from_tree(tree, c, "cpu"))], backend=backend)
        assert torch.allclose(got, ref, atol=1e-4), (backend, (got - ref).abs().max())


def test_causal_chunks_over_the_cache_equal_one_prefill():
    """Prefill, s > 1 plain tokens after a cache (lower-right causal) and the one-token step."""
    model = _tiny("qwen3")
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = model(input_ids=ids[None]).logits[0]
    fwd = TargetForward(model, packed=False)
    pool = fwd.new_pool(2, 32)
    got = torch.cat([fwd(pool, ids[a:b], torch.arange(a, b), [Segment(1, a, b - a)])[0]
                     for a, b in ((0, 20), (20, 29), (29, 30))])
    assert torch.allclose(got, full, atol=1e-4)


def test_segments_of_one_forward_equal_each_sequence_alone():
    """Two sequences in one forward (a causal prefill and a tree) give each one's own outputs."""
    model = _tiny("llama")
    fwd = TargetForward(model, packed=False)
    g = torch.Generator().manual_seed(5)
    a_ids, b_ids = torch.randint(0, 64, (9,), generator=g), torch.randint(0, 64, (13,), generator=g)
    tree = _random_tree(7, seed=6)
    alone = fwd.new_pool(2, 32)
    la, _ = fwd(alone, a_ids, torch.arange(9), [Segment(0, 0, 9)])
    fwd(alone, b_ids, torch.arange(13), [Segment(1, 0, 13)])
    lb, _ = fwd(alone, tree.tokens, tree.position_ids(13)[0], [Segment(1, 13, 7, TreeAttention.from_tree(tree, 13, "cpu"))])
    both = fwd.new_pool(2, 32)
    fwd(both, b_ids, torch.arange(13), [Segment(1, 0, 13)])
    tokens = torch.cat([a_ids, tree.tokens])
    positions = torch.cat([torch.arange(9), tree.position_ids(13)[0]])
    got, _ = fwd(both, tokens, positions, [Segment(0, 0, 9), Segment(1, 13, 7, TreeAttention.from_tree(tree, 13, "cpu"))])
    assert torch.allclose(got, torch.cat([la, lb]), atol=1e-5)
    assert torch.allclose(both.keys[:, 0, :, :9], alone.keys[:, 0, :, :9], atol=1e-6)
    assert torch.allclose(both.keys[:, 1, :, :20], alone.keys[:, 1, :, :20], atol=1e-6)


def test_one_decode_call_equals_per_row_attention_over_each_slot():
    """DecodeBatch: one-token rows over slots 5, 2, 3 (slot 4 between them holds no row, a
    throw-away row) with 3 to 200 keys each give each row's own per-slot attention to rounding;
    garbage past a row's length in its slot is masked."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 8, 2, 16
    keys, values = torch.randn(6, hkv, 256, d, generator=g), torch.randn(6, hkv, 256, d, generator=g)
    slots, lengths, rows = [5, 2, 3], [200, 3, 57], [2, 0, 1]
    q = torch.randn(3, hq, d, generator=g)
    plan = attn.DecodeBatch.plan(slots, lengths, rows, "cpu")
    assert (plan.lo, plan.hi, plan.length) == (2, 6, 200)
    got = plan(q, keys, values, d ** -0.5)
    assert got.shape == (3, hq * d)
    for i, (slot, n, row) in enumerate(zip(slots, lengths, rows)):
        ref = attn.packed_gqa_attention(q[row:row + 1].transpose(0, 1)[None], keys[slot:slot + 1, :, :n],
                                        values[slot:slot + 1, :, :n], d ** -0.5)
        assert torch.allclose(got[i], ref[0].transpose(0, 1).reshape(hq * d), atol=1e-6), i
    keys[2, :, 3:] = 1e4  # past row 1's three keys: must not reach it
    assert torch.allclose(plan(q, keys, values, d ** -0.5)[1], got[1], atol=1e-6)


def test_a_decode_call_is_planned_only_where_it_pays_and_for_distinct_slots():
    assert attn.DecodeBatch.plan([3], [10], [0], "cpu") is None  # one row: the per-row call
    # slots spread over more than DECODE_SLOT_SPAN x rows: throw-away rows would outnumber the real ones
    assert attn.DecodeBatch.plan([0, 4 * attn.DECODE_SLOT_SPAN], [5, 5], [0, 1], "cpu") is None
    assert attn.DecodeBatch.plan([0, 3], [5, 5], [0, 1], "cpu") is not None
    with pytest.raises(ValueError, match="share a slot"):
        attn.DecodeBatch.plan([1, 1], [5, 6], [0, 1], "cpu")
    with pytest.raises(ValueError, match="one entry per row"):
        attn.DecodeBatch.plan([0, 1], [5], [0, 1], "cpu")


def test_a_forward_of_decode_rows_beside_a_tree_and_a_chunk_equals_per_segment_calls(monkeypatch):
    """The engine's forward with one decode call (batch_decode) and with one call per segment:
    three one-token rows, a tree and a prompt chunk in one forward give the same logits and
    pool contents to rounding, and the same greedy tokens."""
    model = _tiny("llama")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 64, (n,), generator=g) for n in (11, 5, 17, 9)]
    tree = _random_tree(6, seed=9)
    chunk = torch.randint(0, 64, (7,), generator=g)
    calls = []
    one_call = attn.DecodeBatch.__call__
    monkeypatch.setattr(attn.DecodeBatch, "__call__", lambda self, *a: calls.append(1) or one_call(self, *a))
    results = []
    for batch_decode in (True, False):
        fwd = TargetForward(model, packed=False, batch_decode=batch_decode)
        pool = fwd.new_pool(6, 64)
        for slot, ids in enumerate(prompts):
            fwd(pool, ids, torch.arange(len(ids)), [Segment(slot, 0, len(ids))])
        nxt = torch.tensor([1, 2, 3])
        tokens = torch.cat([nxt, tree.tokens, chunk])
        positions = torch.cat([torch.tensor([11, 5, 17]), tree.position_ids(9)[0], torch.arange(7)])
        segments = [Segment(0, 11, 1), Segment(1, 5, 1), Segment(2, 17, 1),
                    Segment(3, 9, 6, TreeAttention.from_tree(tree, 9, "cpu")), Segment(5, 0, 7)]
        calls.clear()
        logits, _ = fwd(pool, tokens, positions, segments)
        assert len(calls) == (2 if batch_decode else 0)  # one call per layer, the three rows together
        assert fwd._decode_batch(segments).rows == 3
        written = [(0, 12), (1, 6), (2, 18), (3, 15), (5, 7)]  # (slot, tokens written)
        results.append((logits, torch.cat([pool.keys[:, s, :, :n].flatten() for s, n in written])))
    (a, ka), (b, kb) = results
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.allclose(ka, kb, atol=1e-6)


def test_a_segment_past_its_slot_is_refused_before_any_write():
    from engine.kv_cache import CacheCapacityError

    model = _tiny("llama")
    fwd = TargetForward(model, packed=False)
    pool = fwd.new_pool(1, 8)
    pool.keys.zero_()
    with pytest.raises(CacheCapacityError):
        fwd(pool, torch.zeros(5, dtype=torch.long), torch.arange(4, 9), [Segment(0, 4, 5)])
    assert not pool.keys.any()


def test_select_backend_names_and_auto():
    assert select_backend("sdpa", "cpu") == "sdpa"
    assert select_backend("flex", "cpu") == "flex"
    assert "flash_attn" not in available_backends("cpu")
    with pytest.raises(ValueError, match="not available"):
        select_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("xformers", "cpu")
    cfg = Qwen3Config(num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_size=128)
    times = attn.benchmark_backends("cpu", n_q=8, n_kv=2, head_dim=16, points=((16, 64),), repeats=1)
    assert set(times) == {"sdpa", "flex"} and all(t is not None and t > 0 for t in times.values())
    assert select_backend("auto", "cpu", config=cfg) == "sdpa"


@pytest.mark.skipif(os.environ.get("BASTION_TEST_COMPILE") != "1",
                    reason="compiling flex on CPU takes about 40 s; set BASTION_TEST_COMPILE=1")
def test_compiled_flex_on_cpu_agrees_with_sdpa():
    q, k, v, tree = _case(40, 300, (8, 2, 16), seed=9)
    got = attn.flex_attention_tree(q, k, v, tree, 0.25, compiled=True)
    assert torch.allclose(got, reference_tree_attention(q, k, v, tree, 0.25), atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_engine_with_a_backend_equals_ar(backend):
    """Deep accepted paths with decoys (compaction by gather) through each backend: tokens equal AR."""
    from engine.engine import Engine, make_controller
    from engine.sampling import SamplingParams
    from helpers import OracleDrafter, tiny_target

    target = tiny_target(vocab=64, layers=2, hidden=64)
    prompt = [3, 5, 7, 11, 13]
    ref = Engine(target).generate(prompt, SamplingParams(max_tokens=40)).token_ids
    drafter = OracleDrafter(prompt + ref + [0] * 16, 64, decoy_every=3)
    got = Engine(target, drafter, make_controller("tree", 16), backend=backend).generate(
        prompt, SamplingParams(max_tokens=40))
    assert got.token_ids == ref
    assert got.tau > 3
