"""The published DFlash checkpoint format: write, load, parse, and reject mismatches (docs/method.md, section 2)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafting.dflash import (DFlashModel, DFlashSpec, DrafterLoadError, default_target_layer_ids, load_dflash,
                             make_spec_for_target, save_dflash)
from helpers import tiny_target

QWEN3_8B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "block_size": 16, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 5, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
}


def published_keys(n_layers: int) -> set[str]:
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        p = f"layers.{i}."
        keys |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        keys |= {p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        keys |= {p + f"mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")}
    return keys


def test_published_qwen3_8b_config_builds_right_shapes_on_meta():
    spec = DFlashSpec.from_dict(QWEN3_8B_DRAFTER)
    assert spec.target_layer_ids == [1, 9, 17, 25, 33] and spec.mask_token_id == 151669 and spec.block_size == 16
    with torch.device("meta"):
        m = DFlashModel(spec, target_hidden=4096)
    sd = m.state_dict()
    assert set(sd) == published_keys(5)
    assert sd["fc.weight"].shape == (4096, 5 * 4096)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (32 * 128, 4096)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (8 * 128, 4096)
    assert sd["layers.0.self_attn.q_norm.weight"].shape == (128,)
    assert sd["layers.4.mlp.down_proj.weight"].shape == (4096, 12288)
    n = sum(v.numel() for v in sd.values())
    assert 1.0e9 < n < 1.1e9  # about 1.05 B parameters (docs/method.md, section 2)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    d = dict(QWEN3_8B_DRAFTER, dflash_config={"mask_token_id": 151669})
    assert DFlashSpec.from_dict(d).target_layer_ids == [1, 9, 17, 25, 33]


@pytest.fixture()
def tiny_checkpoint(tmp_path):
    tg = tiny_target(vocab=64, layers=4, hidden=32)
    spec = make_spec_for_target(tg.config, num_layers=2, block_size=8, mask_token_id=63, target_layer_ids=[0, 2])
    torch.manual_seed(1)
    model = DFlashModel(spec, target_hidden=32)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_dflash(model, tmp_path)
    return tg, model, tmp_path


def test_tiny_checkpoint_in_published_format_loads(tiny_checkpoint):
    tg, model, path = tiny_checkpoint
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["block_size"] == 8 and cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 2]}
    assert set(load_file(str(path / "model.safetensors"))) == published_keys(2)
    d = load_dflash(path, tg.model)
    assert d.feature_layers == (1, 3) and d.max_depth == 7
    for k, v in model.state_dict().items():
        assert torch.equal(d.model.state_dict()[k], v)
    st = d.new_state()
    d.extend(st, [1, 2, 3], torch.randn(3, 64))
    m = d.propose(st, 5, 7)
    assert m.token_ids.shape == (7, 64) and m.logprobs.shape == (7, 64)
    assert torch.all(m.logprobs[:, :-1] >= m.logprobs[:, 1:])
    assert st.ctx_len == 3 and st.cache.length == 3  # only context entries are cached


def test_incremental_context_equals_one_shot(tiny_checkpoint):
    tg, _, path = tiny_checkpoint
    d = load_dflash(path, tg.model)
    feats = torch.randn(6, 64)
    a, b = d.new_state(), d.new_state()
    d.extend(a, [1, 2, 3, 4, 5, 6], feats)
    one = d.propose(a, 9, 7)
    d.extend(b, [1, 2, 3, 4], feats[:4])
    d.propose(b, 5, 7)
    d.extend(b, [5, 6], feats[4:])
    two = d.propose(b, 9, 7)
    assert torch.allclose(one.logprobs, two.logprobs, atol=1e-5)
    assert torch.equal(one.token_ids[:, :3], two.token_ids[:, :3])


def test_mismatching_checkpoint_lists_every_problem(tiny_checkpoint):
    tg, _, path = tiny_checkpoint
    sd = load_file(str(path / "model.safetensors"))
    sd.pop("norm.weight")
    sd["extra.weight"] = torch.zeros(2)
    sd["fc.weight"] = torch.zeros(32, 96)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(DrafterLoadError) as e:
        load_dflash(path, tg.model)
    msg = str(e.value)
    assert "missing norm.weight" in msg and "unexpected extra.weight" in msg and "fc.weight: file (32, 96)" in msg


def test_drafter_for_another_target_is_refused(tiny_checkpoint):
    _, _, path = tiny_checkpoint
    other = tiny_target(vocab=64, layers=2, hidden=48)
    with pytest.raises(DrafterLoadError) as e:
        load_dflash(path, other.model)
    assert "num_target_layers=4 but the target has 2 layers" in str(e.value)
    assert "hidden_size=32" in str(e.value)


def test_bad_paths(tmp_path):
    tg = tiny_target()
    with pytest.raises(DrafterLoadError, match="neither an existing folder"):
        load_dflash("./does/not/exist", tg.model)
    with pytest.raises(DrafterLoadError, match="no config.json"):
        load_dflash(tmp_path, tg.model)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DrafterLoadError, match="not valid JSON"):
        load_dflash(tmp_path, tg.model)


def test_bfloat16_drafter_under_a_float32_target(tiny_checkpoint):
    tg, model, path = tiny_checkpoint
    ref = load_dflash(path, tg.model)
    d = load_dflash(path, tg.model, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d._head_w.dtype == torch.bfloat16
    assert tg.model.lm_head.weight.dtype == torch.float32  # the shared target weights stay as they are
    feats = torch.randn(4, 64)  # float32 features from the target, cast by the drafter
    outs = []
    for drafter in (ref, d):
        st = drafter.new_state()
        drafter.extend(st, [1, 2, 3, 4], feats)
        outs.append(drafter.propose(st, 5, 7))
    assert outs[1].token_ids.shape == (7, 64)
    # Same proposals up to bfloat16 rounding: the top token of each depth agrees where it is clear.
    lp32 = outs[0].logprobs
    clear = (lp32[:, 0] - lp32[:, 1]) > 0.2
    assert torch.equal(outs[1].token_ids[clear, 0], outs[0].token_ids[clear, 0])


def test_drafter_dtype_choice_converts_only_for_a_clear_gain(tiny_checkpoint, monkeypatch):
    import drafting.dflash as dflash_mod

    tg, model, path = tiny_checkpoint
    for bf16_s, want in ((0.006, torch.bfloat16), (0.0095, torch.float32)):
        d = load_dflash(path, tg.model)
        before = {k: v.clone() for k, v in d.model.state_dict().items()}
        monkeypatch.setattr(dflash_mod, "time_drafter_pass",
                            lambda dr: 0.010 if dr.dtype == torch.float32 else bf16_s)
        dt, times = dflash_mod.choose_drafter_dtype(d)
        assert dt == want and d.dtype == want
        assert times == {"float32": 0.010, "bfloat16": bf16_s}
        if want == torch.float32:  # the trial ran on a copy: the loaded weights are untouched
            assert all(torch.equal(d.model.state_dict()[k], v) for k, v in before.items())


def test_drafter_pass_timer_runs_a_real_pass(tiny_checkpoint):
    import drafting.dflash as dflash_mod

    tg, _, path = tiny_checkpoint
    d = load_dflash(path, tg.model)
    assert 0 < dflash_mod.time_drafter_pass(d, context=5, rows=2, repeats=2) < 5.0
