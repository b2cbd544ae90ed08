"""A measure function for calibration: time one Hugging Face target forward of s tokens over c cached tokens."""
from __future__ import annotations

import inspect
import time
from typing import Callable

import torch
from transformers import DynamicCache


def _random_cache(model, c: int, device: torch.device, dtype: torch.dtype) -> DynamicCache:
    """A DynamicCache holding c positions of random keys/values in every layer (values do not change timing)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    g = torch.Generator(device="cpu").manual_seed(c)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(1, n_kv, c, head_dim, generator=g).to(device=device, dtype=dtype)
        cache.update(k, k.clone(), layer)
    return cache


def hf_forward_timer(model: torch.nn.Module) -> Callable[[int, int], float]:
    """Return measure_fn(s, c) -> seconds of one forward of `model` with s new tokens over c cached ones.

    The cache of c positions is filled with random keys/values (no prefill: a forward's cost does
    not depend on cached values) and cropped back to c after each call; one cache is kept per c,
    so iterate the grid c-major. Inputs: random token ids, positions c..c+s-1, causal attention.
    On CUDA the device is synchronised around the forward. The engine may supply its own timer
    that goes through its tree-attention path instead.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else model.config.vocab_size
    caches: dict[int, DynamicCache] = {}
    # transformers 5.x names the argument `cache`; older releases `past_key_values`.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @torch.inference_mode()
    def measure(s: int, c: int) -> float:
        if c not in caches:
            caches.clear()
            caches[c] = _random_cache(model, c, device, dtype)
        cache = caches[c]
        ids = torch.randint(0, vocab, (1, s), device=device)
        pos = torch.arange(c, c + s, device=device).unsqueeze(0)
        sync()
        t0 = time.perf_counter()
        model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=0, **{cache_kw: cache})
        sync()
        elapsed = time.perf_counter() - t0
        cache.crop(-s)  # negative: drop the s positions just written
        return elapsed

    measure.caches = caches  # type: ignore[attr-defined]  (inspection in tests)
    return measure
