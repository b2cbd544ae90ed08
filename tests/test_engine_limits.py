"""Engine pieces that keep a server safe: tiny temperatures, feature capture, bounded detokenising."""
from __future__ import annotations

import math

import pytest
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.engine import Engine
from engine.sampling import GREEDY_EPSILON, MAX_STOP_CHARS, RequestError, SamplingParams
from engine.forward import Segment, TargetForward
from reference import gather_features
from helpers import tiny_target


def test_tiny_temperatures_decode_greedily_instead_of_failing(target_f32):
    eng = Engine(target_f32)
    ids = eng.chat_prompt_ids([{"role": "user", "content": "Say hi"}])
    greedy = eng.generate(ids, SamplingParams(temperature=0.0, max_tokens=6)).token_ids
    for t in (1e-300, 1e-40, GREEDY_EPSILON / 2):
        params = SamplingParams(temperature=t, max_tokens=6, seed=1)
        assert params.greedy
        assert eng.generate(ids, params).token_ids == greedy  # before: inf/NaN logits, RuntimeError
    assert not SamplingParams(temperature=GREEDY_EPSILON).greedy


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan),
                                         ("temperature", 3.0), ("max_tokens", 0), ("top_k", -1),
                                         ("stop", ["x" * (MAX_STOP_CHARS + 1)])])
def test_bad_sampling_values_name_their_parameter(field, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


def test_forward_features_equal_the_models_hidden_states():
    target = tiny_target(vocab=16, layers=3, hidden=32)
    model = target.model
    layers = (0, 1, 3, 2)  # embeddings, a middle layer, the final (normed) output, any order
    ids = torch.tensor([1, 5, 2, 7, 3])
    with torch.inference_mode():
        full = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    fwd = TargetForward(model, packed=False)
    pool = fwd.new_pool(1, 16)
    logits, feats = fwd(pool, ids, torch.arange(5), [Segment(0, 0, 5)], layers)
    torch.testing.assert_close(feats, gather_features(full.hidden_states, layers), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full.logits[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside 0..3"):
        fwd(pool, ids, torch.arange(5), [Segment(0, 0, 5)], (4,))


class CountingTokenizer:
    """A fast-tokenizer stand-in that counts the ids its full decode is asked for."""

    def __init__(self, inner):
        self.inner = inner
        self._tokenizer = inner._tokenizer
        self.clean_up_tokenization_spaces = inner.clean_up_tokenization_spaces
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_work_per_step_does_not_grow_with_the_output(target_f32):
    tok = CountingTokenizer(target_f32.tokenizer)
    text = "Tokens, words and numbers 12345 — ünïcödé 日本語 🙂 repeated. " * 60
    ids = target_f32.tokenizer(text, add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tok, stop=["never appears"])
    out = []
    for i in range(0, len(ids), 3):
        det.add(ids[i:i + 3])
        out.append(det.release())
    out.append(det.release(final=True))
    assert "".join(out) == target_f32.tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.decoded == 0  # the stream decodes token by token; no whole-output decode
    assert len(det.text) < 4096 + 2 * len("never appears") + 200  # released text far behind is dropped


def test_detokenizer_stop_string_cut_is_exact_with_the_stream(target_f32):
    tok = target_f32.tokenizer
    ids = tok("alpha beta gamma delta epsilon", add_special_tokens=False)["input_ids"]
    det = IncrementalDetokenizer(tok, stop=["ta gam"])
    kept = det.add(ids)
    assert det.stopped and det.release(final=True) == "alpha be"
    # Kept tokens end with the one completing the stop string.
    assert "ta gam" in tok.decode(ids[:kept]) and "ta gam" not in tok.decode(ids[:kept - 1])
