"""Test doubles (an oracle drafter that proposes a known continuation, a tiny random target) and
`expand`, which materialises any proposal through the one tree builder."""
from __future__ import annotations

import math

import torch

from drafting.base import Drafter
from drafting.proposal import CandidateTree, Marginals, Proposal
from engine.tree import FixedBudgetPolicy, build_tree


def expand(proposal: Proposal, cap: int, max_depth: int, top_k: int | None = None) -> CandidateTree:
    """The best-first top-`cap` candidates of `proposal` (root excluded) as a CandidateTree,
    grown by `engine.tree.build_tree`: tokens in insertion order, parents as candidate
    indices (-1 for the root's children), logprobs the conditional log-scores."""
    tree = build_tree(-1, proposal, FixedBudgetPolicy(cap + 1, top_k=top_k), max_depth)
    par = tree.parents.tolist()
    logs = tree.log_scores.tolist()
    cond = [logs[i] - logs[par[i]] for i in range(1, tree.size)]
    return CandidateTree(tokens=tree.tokens[1:].clone(), parents=tree.parents[1:] - 1,
                         logprobs=torch.tensor(cond, dtype=torch.float32))


class OracleDrafter(Drafter):
    """Proposes the known continuation `reference` (prompt + expected output) as marginals.

    At depth d the true token gets probability p_true; other ranks hold random tokens.
    With decoy_every=k, every k-th depth ranks a wrong token first, so best-first trees
    accept along paths that are not a prefix of insertion order (exercises compaction).
    """

    def __init__(self, reference: list[int], vocab: int, max_depth: int = 15, k: int = 4,
                 p_true: float = 0.9, decoy_every: int = 0, seed: int = 0):
        self.reference = list(reference)
        self.vocab = vocab
        self.max_depth = max_depth
        self.k = k
        self.p_true = p_true
        self.decoy_every = decoy_every
        self.gen = torch.Generator().manual_seed(seed)

    def new_state(self):
        return {"n": 0}

    def extend(self, state, token_ids, features):
        state["n"] += len(token_ids)

    def propose(self, state, root, max_depth):
        pos = state["n"] + 1  # index in reference of the token after the root
        depth = min(max_depth, self.max_depth)
        ids = torch.randint(0, self.vocab, (depth, self.k), generator=self.gen)
        rest = (1 - self.p_true) / max(1, self.k - 1)
        lps = torch.full((depth, self.k), math.log(rest))
        for d in range(depth):
            true = self.reference[pos + d] if pos + d < len(self.reference) else 0
            if self.decoy_every and (d + 1) % self.decoy_every == 0 and self.k > 1:
                decoy = (true + 1) % self.vocab
                ids[d, 0], ids[d, 1] = decoy, true
                lps[d, 0], lps[d, 1] = math.log(0.55), math.log(0.4)
            else:
                ids[d, 0] = true
                lps[d, 0] = math.log(self.p_true)
            # Other ranks must not duplicate rank-0/1 tokens.
            for r in range(2 if self.decoy_every else 1, self.k):
                while ids[d, r] in ids[d, :r]:
                    ids[d, r] = (ids[d, r] + 1) % self.vocab
        return Marginals(token_ids=ids, logprobs=lps)


class SpaceTokenizer:
    """Decodes ids as space-separated numbers (for tiny random targets without a vocabulary)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


def tiny_target(vocab: int = 8, seed: int = 0, layers: int = 2, hidden: int = 32, sharpen: float = 40.0):
    """A tiny random Llama target (float32) wrapped as engine.loader.Target, with no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import Target

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    # Sharper logits than the default init so the distribution is far from uniform.
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.generation_config.eos_token_id = None
    return Target(model=model, tokenizer=SpaceTokenizer(), name="tiny", dtype=torch.float32)


class ShuffledMarginalsDrafter(Drafter):
    """Marginals over the whole (small) vocabulary in a random order with Zipf-like scores.

    Gives wide trees that contain many of the target's likely tokens, so both acceptance
    and bonus paths occur often; costs no model forward.
    """

    def __init__(self, vocab: int, max_depth: int = 6, seed: int = 0):
        self.vocab = vocab
        self.max_depth = max_depth
        self.gen = torch.Generator().manual_seed(seed)
        w = torch.tensor([1.0 / (r + 1) for r in range(vocab)])
        self.logprobs = torch.log(w / w.sum())

    def new_state(self):
        return None

    def extend(self, state, token_ids, features):
        pass

    def propose(self, state, root, max_depth):
        d = min(max_depth, self.max_depth)
        ids = torch.stack([torch.randperm(self.vocab, generator=self.gen) for _ in range(d)])
        return Marginals(token_ids=ids, logprobs=self.logprobs.expand(d, -1).clone())


def ar_references(target, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Per prompt: (chat-templated prompt ids, the engine's plain greedy output ids)."""
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    ar = Engine(target)
    out = []
    for p in prompts:
        ids = ar.chat_prompt_ids([{"role": "user", "content": p}])
        out.append((ids, ar.generate(ids, SamplingParams(max_tokens=max_tokens)).token_ids))
    return out
