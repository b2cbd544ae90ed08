"""Exactness at temperature 0: every speculative mode emits the tokens of plain greedy decoding."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, make_controller
from engine.sampling import SamplingParams
from helpers import OracleDrafter, ar_references

PROMPTS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Explain recursion in one paragraph.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into French and Spanish.",
    "Write a Python function that reverses a string.",
    "What is the capital of Australia?",
    "Give me a short motivational quote.",
    "How do plants make food?",
    "Summarize the plot of Cinderella in two sentences.",
    "What are the primary colors?",
    "Write a SQL query that counts rows in a table named users.",
    "Why do cats purr?",
    "Name four planets of the solar system.",
    "Describe a rainy afternoon in a small town.",
    "If a train travels 60 km in one hour, how far does it go in 3 hours?",
    "Write a limerick about a programmer.",
    "What does HTTP stand for?",
    "Give two tips for better sleep.",
    "Convert 100 degrees Fahrenheit to Celsius.",
]
MAX_TOKENS = 32
RANDOM_TOKENS = 16  # the random drafter is rejected at almost every step: 16 steps cover that path
RANDOM_PROMPTS = slice(None, None, 2)  # ... and every other prompt does (160 rejected trees a mode)
MODES = [("chain", 16), ("tree", 8), ("tree", 32), ("tree", 128)]


@pytest.fixture(scope="module")
def references(target_f32):
    """Per prompt: (prompt ids, engine AR output ids)."""
    return ar_references(target_f32, PROMPTS, MAX_TOKENS)


def test_engine_ar_equals_transformers_generate(target_f32, references):
    eos = target_f32.eos_token_ids
    for ids, ref in references:
        hf = target_f32.model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        hf = hf[0, len(ids):].tolist()
        if hf and hf[-1] in eos:
            hf = hf[:-1]
        assert ref == hf


def test_random_drafter_modes_equal_ar(target_f32, random_drafter, references):
    for mode, budget in MODES:
        eng = Engine(target_f32, random_drafter, make_controller(mode, budget))
        for ids, ref in references[RANDOM_PROMPTS]:
            r = eng.generate(ids, SamplingParams(max_tokens=RANDOM_TOKENS))
            assert r.token_ids == ref[:RANDOM_TOKENS], (mode, budget)
            assert all(s.tree_size <= (16 if mode == "chain" else budget) for s in r.steps)


@pytest.mark.parametrize("decoy", [0, 3])
def test_oracle_drafter_modes_equal_ar_with_long_accepts(target_f32, references, decoy):
    vocab = target_f32.config.vocab_size
    for mode, budget in MODES:
        taus = []
        for ids, ref in references:
            d = OracleDrafter(ids + ref + [0] * 16, vocab, decoy_every=decoy)
            eng = Engine(target_f32, d, make_controller(mode, budget))
            r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
            assert r.token_ids == ref, (mode, budget, decoy)
            taus.append(r.tau)
        if not (mode == "chain" and decoy) and budget >= 16:
            # The true path is in the tree: most steps accept a long path (decoys cost some depth).
            assert sum(taus) / len(taus) > (5 if decoy else 8), (mode, budget, decoy, taus)


def synthetic_controller():
    """The adaptive controller over a fixed roofline shaped like this CPU (no calibration run)."""
    from prometheus_client import CollectorRegistry

    from controller.ceilings import Ceilings
    from controller.cost_model import ModelShape
    from controller.latency_model import LatencyModel, LatencyParams
    from controller.policy import PolicySettings
    from controller.budget import BudgetController

    shape = ModelShape(layers=30, hidden=576, n_q=9, n_kv=3, head_dim=64, ffn=1536, vocab=49152,
                       bytes_per_param=4, tied_embeddings=True)
    model = LatencyModel(shape, Ceilings(60e9, 12e9, "synthetic cpu"), LatencyParams(1.6, 4e-3, 1.3, 6e-3))
    return BudgetController(model, PolicySettings(1, 256, 1, 64), registry=CollectorRegistry())


def test_bastion_mode_equals_ar(target_f32, random_drafter, references):
    vocab = target_f32.config.vocab_size
    sizes = []
    for ids, ref in references[:6]:
        d = OracleDrafter(ids + ref + [0] * 16, vocab, decoy_every=3)
        r = Engine(target_f32, d, synthetic_controller()).generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert r.token_ids == ref
        sizes += [s.tree_size for s in r.steps]
    # The adaptive policy grew real trees (and sized them per step).
    assert len(set(sizes)) >= 2 and max(sizes) > 4
    for ids, ref in references[:3]:
        eng = Engine(target_f32, random_drafter, synthetic_controller())
        r = eng.generate(ids, SamplingParams(max_tokens=RANDOM_TOKENS))
        assert r.token_ids == ref[:RANDOM_TOKENS]
        # A useless drafter: the gate turns drafting off after its probe steps.
        assert any(not s.drafted for s in r.steps)


def test_shipped_drafter_in_bfloat16_under_a_float32_target_equals_ar(target_f32, references):
    """The drafter's dtype changes its proposals, never the output: verification decides."""
    from bastion.factory import load_drafter

    drafter = load_drafter("dflash", target_f32, "bfloat16")
    assert drafter.dtype == torch.bfloat16 and target_f32.dtype == torch.float32
    eng = Engine(target_f32, drafter, make_controller("tree", 16))
    accepted = []
    for ids, ref in references[:6]:
        r = eng.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))
        assert r.token_ids == ref
        accepted += [s.accepted for s in r.steps]
    # Still a working drafter: more than one token a step on average (about 2 in float32).
    assert sum(accepted) / len(accepted) > 1.4
