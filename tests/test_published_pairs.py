"""The published pairs' loading path without downloads.

1. Configs identical to the published targets (Qwen/Qwen3-4B, Qwen/Qwen3-8B,
   meta-llama/Llama-3.1-8B-Instruct) and their z-lab DFlash drafters are instantiated on the
   meta device; module shapes, weight keys and parameter counts are checked.
2. Tiny checkpoints written in exactly the published layout (a sharded Hugging Face target
   folder with tokenizer and chat template; a drafter folder with config.json + one
   model.safetensors, no embedding, no lm_head) load through bastion.factory.build_engine and
   generate, equal to AR at temperature 0.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from drafting.dflash import DFlashModel, DFlashSpec, check_fits_target, load_dflash, save_dflash

# ---- published configs (public model cards / config.json files) --------------------------------

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}
QWEN3_4B = dict(QWEN3_8B, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}


def drafter_config(target: dict, mask_token_id: int, target_layer_ids: list[int]) -> dict:
    """A z-lab DFlash drafter config for `target`: a Qwen3 config of the target's width with 5 layers."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
            "attention_bias")
    d = {k: target[k] for k in keep}
    d.update({
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "num_hidden_layers": 5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "block_size": 16, "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
    })
    return d


# z-lab/Qwen3-8B-DFlash-b16 as published; the 4B drafter reads the same layers of its 36-layer target.
# The Llama drafter's mask token (<|reserved_special_token_0|>) and layer ids (the default
# spacing for 32 layers) are derived, not copied from the hub.
PAIRS = {
    "Qwen3-8B": (QWEN3_8B, drafter_config(QWEN3_8B, 151669, [1, 9, 17, 25, 33]), 8_190_735_360, 1_048_626_432),
    "Qwen3-4B": (QWEN3_4B, drafter_config(QWEN3_4B, 151669, [1, 9, 17, 25, 33]), 4_022_468_096, 537_427_200),
    "Llama-3.1-8B-Instruct": (LLAMA31_8B, drafter_config(LLAMA31_8B, 128002, [1, 8, 15, 22, 29]),
                              8_030_261_248, 1_174_455_552),
}


def _layer_params(h: int, n_q: int, n_kv: int, d: int, f: int, qk_norm: bool) -> int:
    attn = h * n_q * d + 2 * h * n_kv * d + n_q * d * h
    return attn + 3 * h * f + 2 * h + (2 * d if qk_norm else 0)


def _config(d: dict):
    d = {k: v for k, v in d.items() if k not in ("architectures", "torch_dtype")}
    return AutoConfig.for_model(**d)


@pytest.mark.parametrize("name", list(PAIRS))
def test_published_target_and_drafter_on_the_meta_device(name):
    tdict, ddict, target_params, drafter_params = PAIRS[name]
    cfg = _config(tdict)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(cfg)
    h, f, V, L = tdict["hidden_size"], tdict["intermediate_size"], tdict["vocab_size"], tdict["num_hidden_layers"]
    qwen = tdict["model_type"] == "qwen3"
    expect = L * _layer_params(h, 32, 8, 128, f, qwen) + h + V * h * (1 if tdict["tie_word_embeddings"] else 2)
    n_target = sum(p.numel() for p in target.parameters())
    assert n_target == expect == target_params
    attn = target.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (32 * 128, h)
    assert tuple(attn.k_proj.weight.shape) == (8 * 128, h)
    assert tuple(target.model.layers[0].mlp.gate_proj.weight.shape) == (f, h)

    spec = DFlashSpec.from_dict(ddict)
    assert check_fits_target(spec, cfg) == []
    with torch.device("meta"):
        drafter = DFlashModel(spec, target_hidden=h)
    sd = drafter.state_dict()
    assert not any("embed" in k or "lm_head" in k for k in sd)
    assert tuple(sd["fc.weight"].shape) == (h, 5 * h)
    assert tuple(sd["layers.4.self_attn.q_norm.weight"].shape) == (128,)
    assert tuple(sd["layers.0.self_attn.k_proj.weight"].shape) == (1024, h)
    assert tuple(sd["layers.0.mlp.down_proj.weight"].shape) == (h, f)
    assert set(k.split(".")[0] for k in sd) == {"fc", "hidden_norm", "layers", "norm"}
    n_drafter = sum(p.numel() for p in drafter.parameters())
    assert n_drafter == 5 * h * h + 2 * h + 5 * _layer_params(h, 32, 8, 128, f, True) == drafter_params
    if name == "Qwen3-8B":
        assert 1.04e9 < n_drafter < 1.06e9  # "about 1.05 B parameters" (docs/method.md, section 2)
        assert spec.target_layer_ids == [1, 9, 17, 25, 33] and spec.mask_token_id == 151669


# ---- tiny checkpoints in the published layout, end to end -------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
WORDS = [f"w{i}" for i in range(120)] + ["user", "assistant", "system"]
# The Qwen3 template's behaviour that matters here: enable_thinking=false closes an empty think block.
QWEN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = QWEN_TEMPLATE
    return fast


def _write_pair(tmp_path, kind: str):
    """Write a tiny target folder (sharded safetensors) and a drafter folder; return their paths."""
    tok = _tokenizer()
    V = 128
    base = QWEN3_8B if kind == "qwen3" else LLAMA31_8B
    tdict = dict(base, vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if kind == "llama":
        tdict["rope_scaling"] = dict(LLAMA31_8B["rope_scaling"], original_max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(tdict)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # sharp logits: no near-ties at temperature 0
    tfolder = tmp_path / f"{kind}-target"
    model.save_pretrained(tfolder, max_shard_size="100KB")  # sharded, like the published checkpoints
    tok.save_pretrained(tfolder)
    assert (tfolder / "model.safetensors.index.json").is_file()

    ddict = drafter_config(tdict, tok.convert_tokens_to_ids("<|mask|>"), [1, 2])
    ddict["num_hidden_layers"] = 2
    ddict["num_target_layers"] = 4
    spec = DFlashSpec.from_dict(ddict)
    torch.manual_seed(1)
    drafter = DFlashModel(spec, target_hidden=64)
    dfolder = tmp_path / f"{kind}-drafter"
    save_dflash(drafter, dfolder)
    # Published files: the hub config (auto_map, bfloat16) and bfloat16 weights.
    (dfolder / "config.json").write_text(json.dumps(ddict, indent=2))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()},
              str(dfolder / "model.safetensors"), metadata={"format": "pt"})
    return tfolder, dfolder


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tiny_published_layout_loads_and_tree_decoding_equals_ar(tmp_path, kind):
    from bastion.factory import build_engine
    from bastion.settings import EngineSettings
    from engine.sampling import SamplingParams

    tfolder, dfolder = _write_pair(tmp_path, kind)
    # float32 for both: dtype "auto" decides by timing, and the two engines could pick differently.
    tree = build_engine(EngineSettings(target=str(tfolder), drafter=str(dfolder), mode="tree", budget=8,
                                       dtype="float32"))
    ar = build_engine(EngineSettings(target=str(tfolder), drafter="none", mode="ar", dtype="float32"))
    assert tree.drafter is not None and tree.drafter.feature_layers == (2, 3)
    msgs = [{"role": "user", "content": "w1 w2 w3 w4 w5"}]
    ids = tree.chat_prompt_ids(msgs)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = ar.generate(ids, params)
    got = tree.generate(ids, params)
    assert len(ref.token_ids) == 24
    assert got.token_ids == ref.token_ids
    assert max(s.tree_size for s in got.steps) <= 8 and any(s.tree_size > 1 for s in got.steps)

    # The engine passes enable_thinking=False to every template (templates that do not read it ignore
    # it); with this Qwen3-style template an empty think block closes the prompt.
    toks = tree.tokenizer.convert_ids_to_tokens(tree.chat_prompt_ids(msgs))
    assert toks[-2:] == ["<think>", "</think>"]


def test_save_dflash_checkpoint_loads_like_the_published_one(tmp_path):
    tfolder, dfolder = _write_pair(tmp_path, "qwen3")
    model = AutoModelForCausalLM.from_pretrained(tfolder)
    published = load_dflash(dfolder, model)
    resaved = tmp_path / "resaved"
    save_dflash(published.model, resaved)
    again = load_dflash(resaved, model)
    for (k, a), (k2, b) in zip(published.model.state_dict().items(), again.model.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    cfg = json.loads((resaved / "config.json").read_text())
    assert cfg["dflash_config"] == json.loads((dfolder / "config.json").read_text())["dflash_config"]
