"""Analytic cost of one target forward: FLOPs and bytes moved (docs/method.md, section 7).

A forward pass verifies `s` new tokens over a KV cache of `c` tokens. The counts come
from the target's own Hugging Face config, so Llama, Qwen2, Qwen3 and Mistral decoder
layouts (grouped-query attention, gated MLP, optional tied embeddings) need no table.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

#: Model types whose decoder layout matches the formulas below.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def dtype_bytes(dtype: torch.dtype | str | None) -> int:
    """Bytes per element of `dtype` (torch dtype or its name, e.g. 'bfloat16'); None -> 4.

    Raises ValueError for a name torch does not know.
    """
    if dtype is None:
        return 4
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = resolved
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the cost model needs (all counts, not bytes, except `bytes_per_param`).

    layers L, hidden h, query heads n_q, KV heads n_kv, head dim d, FFN width f, vocab V,
    bytes_per_param b (weights, KV cache and activations share the model's dtype),
    tied_embeddings: the LM head reuses the input embedding matrix,
    qk_norm: per-head RMSNorm on queries and keys (Qwen3), counted in parameters only.
    """

    layers: int
    hidden: int
    n_q: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    bytes_per_param: int
    tied_embeddings: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | str | None = None) -> "ModelShape":
        """Read the shape from a Hugging Face config (Llama, Qwen2, Qwen3, Mistral).

        dtype: the dtype the target runs in; default the config's own `dtype`/`torch_dtype`,
        else float32. head_dim falls back to hidden // n_q when the config has none.
        Raises ValueError when the model type is not a supported decoder layout.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"cost model supports {SUPPORTED_MODEL_TYPES}, got model_type={model_type!r}")
        hidden = int(config.hidden_size)
        n_q = int(config.num_attention_heads)
        n_kv = int(getattr(config, "num_key_value_heads", None) or n_q)
        head_dim = int(getattr(config, "head_dim", None) or hidden // n_q)
        if dtype is None:
            dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        return cls(
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            n_q=n_q,
            n_kv=n_kv,
            head_dim=head_dim,
            ffn=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            bytes_per_param=dtype_bytes(dtype),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
        )

    def to_dict(self) -> dict:
        """Plain-dict form (JSON-serialisable), e.g. for a calibration cache key."""
        return asdict(self)

    # ---- parameters -------------------------------------------------------------------

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention projections, gated MLP, norms."""
        h, d = self.hidden, self.head_dim
        attn = h * self.n_q * d + 2 * h * self.n_kv * d + self.n_q * d * h
        mlp = 3 * h * self.ffn
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return attn + mlp + norms

    @property
    def embedding_params(self) -> int:
        """V * h, the input embedding table."""
        return self.vocab * self.hidden

    @property
    def n_params(self) -> int:
        """Total parameter count: embedding, L layers, final norm, LM head unless tied."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.layers * self.layer_params + self.hidden + lm_head

    # ---- per-forward costs --------------------------------------------------------------

    def flops(self, s, c):
        """FLOPs of one forward with s new tokens over c cached tokens (docs/method.md, section 7).

        Per layer: projections 2s*h*n_q*d + 4s*h*n_kv*d + 2s*n_q*d*h, attention
        4s*(c+s)*n_q*d (QK^T and PV), gated MLP 6s*h*f; plus the LM head 2s*h*V.
        Norms, RoPE and softmax are lower order and left out.
        s, c: ints or numpy arrays of the same shape (broadcast). Returns float(s) in FLOPs.
        """
        s = np.asarray(s, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        h, d, nq, nkv, f = self.hidden, self.head_dim, self.n_q, self.n_kv, self.ffn
        proj = 2 * s * h * nq * d + 4 * s * h * nkv * d + 2 * s * nq * d * h
        attn = 4 * s * (c + s) * nq * d
        mlp = 6 * s * h * f
        out = self.layers * (proj + attn + mlp) + 2 * s * h * self.vocab
        return float(out) if out.ndim == 0 else out

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a forward reads once: every layer, the final norm and the LM head.

        The input embedding is a gather of s rows, counted in `activation_bytes`, so an
        untied embedding table is not read in full (tied: the LM head reads it anyway).
        """
        return (self.layers * self.layer_params + self.hidden + self.embedding_params) * self.bytes_per_param

    def kv_bytes(self, s, c):
        """KV-cache traffic: read 2*L*c*n_kv*d*b, write 2*L*s*n_kv*d*b (bytes)."""
        s = np.asarray(s, dtype=np.float64)
        c = np.asarray(c, dtype=np.float64)
        per_token = 2 * self.layers * self.n_kv * self.head_dim * self.bytes_per_param
        out = per_token * (c + s)
        return float(out) if out.ndim == 0 else out

    def activation_bytes(self, s):
        """Activation traffic (bytes), written and read once per major op, fused attention assumed.

        Per layer and token: x in/out of attention and MLP (4h), q/k/v/attention output
        (2*n_q*d + 2*n_kv*d), MLP gate/up/product (3f); plus embedding gather (h) and
        logits (V) per token. The s x (c+s) score matrix is not materialised (flash/SDPA).
        """
        s = np.asarray(s, dtype=np.float64)
        h, d = self.hidden, self.head_dim
        per_layer = 4 * h + 2 * self.n_q * d + 2 * self.n_kv * d + 3 * self.ffn
        out = s * (self.layers * per_layer + h + self.vocab) * self.bytes_per_param
        return float(out) if out.ndim == 0 else out

    def bytes(self, s, c):
        """Bytes moved by one forward: weights once + KV read/write + activations (docs/method.md, section 7).

        s, c: ints or numpy arrays (broadcast). Returns float(s) in bytes.
        """
        return self.weight_bytes + self.kv_bytes(s, c) + self.activation_bytes(s)
