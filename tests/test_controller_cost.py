"""Cost model counts: a hand-computed tiny config, real module parameter counts, and Qwen3-8B's shape."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen3Config, Qwen3ForCausalLM

from controller.cost_model import ModelShape, dtype_bytes

TINY = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, vocab_size=32, tie_word_embeddings=False)


def test_hand_computed_tiny_config():
    shape = ModelShape.from_config(LlamaConfig(**TINY), torch.float32)
    assert (shape.layers, shape.hidden, shape.n_q, shape.n_kv, shape.head_dim, shape.ffn, shape.vocab) == \
        (2, 8, 2, 1, 4, 16, 32)
    # s = 3 new tokens over c = 5 cached.
    # per layer: proj 2*3*8*2*4 + 4*3*8*1*4 + 2*3*2*4*8 = 384+384+384; attn 4*3*8*2*4 = 768; mlp 6*3*8*16 = 2304
    # 2 layers * 4224 + LM head 2*3*8*32 = 1536
    assert shape.flops(3, 5) == 2 * 4224 + 1536 == 9984
    # params: layer 64+64+64 (q,k+v,o) + 384 mlp + 16 norms = 592; 2 layers + embed 256 + norm 8 + head 256
    assert shape.n_params == 2 * 592 + 256 + 8 + 256 == 1704
    # bytes: weights (1184 + 8 + 256)*4 = 5792; KV 2*2*1*4*4*(5+3) = 512;
    # activations 3 tokens * (2*(32+16+8+48) + 8 + 32) * 4 = 2976
    assert shape.weight_bytes == 5792
    assert shape.kv_bytes(3, 5) == 512
    assert shape.activation_bytes(3) == 2976
    assert shape.bytes(3, 5) == 5792 + 512 + 2976


def test_vectorised_counts_match_scalar():
    import numpy as np
    shape = ModelShape.from_config(LlamaConfig(**TINY), torch.bfloat16)
    s, c = np.array([1, 3, 7]), np.array([0, 5, 100])
    assert shape.flops(s, c).tolist() == [shape.flops(int(a), int(b)) for a, b in zip(s, c)]
    assert shape.bytes(s, c).tolist() == [shape.bytes(int(a), int(b)) for a, b in zip(s, c)]
    assert shape.bytes_per_param == 2


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_matches_real_modules(tied):
    cfg = LlamaConfig(**{**TINY, "tie_word_embeddings": tied})
    model = LlamaForCausalLM(cfg)
    real = sum(p.numel() for p in model.parameters())  # shared tensors counted once
    assert ModelShape.from_config(cfg).n_params == real


def test_qwen3_qk_norm_and_qwen2_head_dim_fallback():
    cfg = Qwen3Config(**TINY)
    assert ModelShape.from_config(cfg).n_params == sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters())
    q2 = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                     num_hidden_layers=1, vocab_size=10)
    assert ModelShape.from_config(q2).head_dim == 16


def test_qwen3_8b_published_shape():
    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    shape = ModelShape.from_config(cfg, torch.bfloat16)
    assert shape.n_params == 8_190_735_360  # "8.2B" on the model card
    # one token over an empty cache: 36 * (2*4096*4096*2 + 4*4096*1024 + 4*32*128 + 6*4096*12288) + 2*4096*151936
    assert shape.flops(1, 0) == 36 * (67_108_864 + 16_777_216 + 16_384 + 301_989_888) + 1_244_659_712
    # ~2 FLOPs per non-embedding weight (norms and attention are tiny)
    assert shape.flops(1, 0) == pytest.approx(2 * (shape.n_params - shape.embedding_params), rel=1e-4)
    # attention over 4096 cached tokens adds 36 * 4 * 4096 * 32 * 128 FLOPs per token
    assert shape.flops(1, 4096) - shape.flops(1, 0) == 36 * 4 * 4096 * 32 * 128
    # bf16 weights read once (the input embedding is a gather, not a full read); KV per token 2*36*8*128*2 bytes
    assert shape.weight_bytes == 2 * (shape.n_params - shape.embedding_params)
    assert shape.kv_bytes(0, 1000) == 1000 * 147_456


def test_rejects_unsupported_and_dtype_names():
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="model_type"):
        ModelShape.from_config(GPT2Config())
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes("torch.float32") == 4 and dtype_bytes(None) == 4
    with pytest.raises(ValueError):
        dtype_bytes("float7")
