"""Sampling parameters and the target's processed next-token distribution."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: Temperatures below this decode greedily (as vLLM does): dividing logits by a smaller one
#: overflows to inf / NaN in float32 and the sampled token would be the argmax anyway.
GREEDY_EPSILON = 1e-5
#: Longest stop string accepted (characters): the hold-back of partial stop strings costs
#: O(length) per step.
MAX_STOP_CHARS = 256


class RequestError(ValueError):
    """A request the engine refuses before doing any work; `param` names the offending field.

    The server answers it with HTTP 400 (every other exception is an internal error).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request decoding parameters.

    temperature: below GREEDY_EPSILON (0 included) means greedy (argmax); above, samples from
    the processed distribution.
    top_p: nucleus mass in (0, 1]; top_k: 0 disables, otherwise keep the k most likely tokens.
    max_tokens: hard cap on generated tokens (bonus tokens included).
    stop: strings that end generation; the stop string itself is not returned.
    seed: seeds the request's own generator (None: nondeterministic).
    ignore_eos: keep generating past EOS (benchmarks).

    Raises RequestError (a ValueError naming the parameter) from `validate` on bad values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self) -> None:
        checks = (
            ("temperature", math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
             f"temperature must be in [0, 2], got {self.temperature}"),
            ("top_p", math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            ("max_tokens", self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            ("stop", all(isinstance(s, str) and s != "" for s in self.stop), "stop strings must be non-empty strings"),
            ("stop", all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop strings may be at most {MAX_STOP_CHARS} characters long"),
        )
        for param, ok, message in checks:
            if not ok:
                raise RequestError(message, param)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below GREEDY_EPSILON."""
        return self.temperature < GREEDY_EPSILON


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p, as probabilities.

    logits: [..., V] float. Returns [..., V] float32 probabilities summing to 1.
    Same processing order as transformers' sampling warpers (temperature, top-k, top-p).
    """
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; always keep the first.
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from one row of logits [V]: argmax when greedy, else one exact sample."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = processed_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


class UniformStream:
    """Uniforms in [0, 1) indexed by output position: the value for position k depends only on the
    generator's seed and k, not on how the positions were grouped into steps.

    Tree acceptance that draws every node at once (engine.acceptance, `draw_all`) samples the node
    at depth d of a step that starts at output position k with the uniform of position k + d.
    Whatever tree a step verifies (a global budget sizes it by what else runs), each output token
    is then the same function of its own uniform, so seeded outputs do not depend on the batch.
    generator: the request's generator (None: the global one); device: where uniforms are made.
    Uniforms are drawn in chunks of CHUNK, in order, so the stream is the same however it is read.
    """

    CHUNK = 256

    def __init__(self, generator: torch.Generator | None, device: torch.device | str):
        self.generator = generator
        self.device = torch.device(device)
        self._buf = torch.empty(0, device=self.device)

    def take(self, start: int, count: int) -> torch.Tensor:
        """Uniforms of positions [start, start + count): [count] float32 on the stream's device.
        Raises ValueError for a negative start or count."""
        if start < 0 or count < 0:
            raise ValueError(f"positions must be non-negative, got start={start} count={count}")
        while self._buf.numel() < start + count:
            more = torch.rand(self.CHUNK, generator=self.generator, device=self.device)
            self._buf = torch.cat([self._buf, more])
        return self._buf[start:start + count]


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i of probs [n, V] sampled with uniform u[i] ([n] in [0, 1)).
    Returns [n] int64: the first index whose cumulative probability exceeds u[i] times the row's
    total (so a zero-probability token is never chosen)."""
    cdf = probs.cumsum(dim=-1)
    target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
    idx = (cdf <= target).sum(dim=-1)
    return idx.clamp(max=probs.shape[-1] - 1)
