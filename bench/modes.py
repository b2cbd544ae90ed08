"""Decoding modes the benchmark compares, all over one loaded target, and the drafter spec they share.

A mode turns a conversation (a list of user turns) into a `Measurement`: the output
tokens and the decode-only timings the report needs. Modes:

    ar-hf     transformers `generate`, greedy or sampled (the library's own AR loop)
    pld       transformers prompt-lookup decoding (`prompt_lookup_num_tokens`), model-free
    ar        the engine, one node per step
    chain     the engine with the drafter's greedy chain (block size nodes)
    tree-N    the engine with best-first trees of N nodes (a fixed budget)
    bastion   the engine with the adaptive budget controller, as served (surrogate correction on)
    bastion-raw  the same trusting the drafter's raw scores (the paper's rule, correction off)

Drafters and the adaptive controller come from the caller (bastion/bench.py builds them
through bastion.factory), so a mode here only decides how a conversation is decoded.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from drafting.base import Drafter
from engine.engine import Engine, make_controller
from engine.loader import Target
from engine.sampling import SamplingParams

#: Mode names in report order; "tree" in a --modes list expands to tree-N for every budget.
BASE_MODES = ("ar-hf", "ar", "chain", "tree", "bastion", "bastion-raw", "pld")
#: Modes that need a drafter.
SPECULATIVE = ("chain", "bastion", "bastion-raw")
#: Modes taken as the AR baseline of the speedup (the faster one wins).
BASELINES = ("ar-hf", "ar")
#: Candidate length of prompt-lookup decoding.
PLD_TOKENS = 10

Encoder = Callable[[list[dict]], list[int]]


@dataclass
class Measurement:
    """One prompt through one mode. Times in seconds (monotonic clock).

    token_ids: output tokens, EOS stripped (all turns concatenated); turn_lengths: tokens per turn.
    ttft_s: prefill + first token of the first turn; decode_s: decode time after each turn's
    first token, summed over turns; decode_tokens: tokens produced in that time (first tokens
    excluded), so TPOT = decode_s / decode_tokens. e2e_s: wall time of the whole conversation.
    steps / accepted / tree_tokens: verification steps after the first token, tokens they
    committed (bonus included) and nodes they verified; tree_tokens is None when unknown (pld).
    """

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    decode_tokens: int
    e2e_s: float
    steps: int
    accepted: int
    tree_tokens: int | None
    turn_lengths: list[int] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        return self.decode_s / self.decode_tokens if self.decode_tokens > 0 else None

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["tpot_s"] = self.tpot_s
        d["tau"] = self.accepted / self.steps if self.steps else None
        d["mean_tree_size"] = (self.tree_tokens / self.steps) if self.steps and self.tree_tokens is not None else None
        return d


@dataclass
class _Turn:
    ids: list[int]
    text: str
    finish: str
    ttft_s: float
    decode_s: float
    decode_tokens: int
    steps: int
    accepted: int
    tree_tokens: int | None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class Mode:
    """A named way of decoding; subclasses implement `_turn` (one user turn, prompt ids in)."""

    name: str = ""

    def __init__(self, name: str, target: Target):
        self.name = name
        self.target = target

    def _turn(self, prompt_ids: list[int], params: SamplingParams) -> _Turn:
        raise NotImplementedError

    def run(self, turns: list[str], encode: Encoder, params: SamplingParams) -> Measurement:
        """Decode every user turn in order, each after the mode's own previous answers."""
        messages: list[dict] = []
        ids_all: list[int] = []
        texts: list[str] = []
        lengths: list[int] = []
        ttft = decode = 0.0
        dtok = steps = accepted = 0
        tree: int | None = 0
        prompt_tokens = 0
        finish = "stop"
        t0 = time.perf_counter()
        for k, user in enumerate(turns):
            messages.append({"role": "user", "content": user})
            prompt_ids = encode(messages)
            if k == 0:
                prompt_tokens = len(prompt_ids)
            t = self._turn(prompt_ids, params)
            if k == 0:
                ttft = t.ttft_s
            decode += t.decode_s
            dtok += t.decode_tokens
            steps += t.steps
            accepted += t.accepted
            tree = None if tree is None or t.tree_tokens is None else tree + t.tree_tokens
            ids_all.extend(t.ids)
            texts.append(t.text)
            lengths.append(len(t.ids))
            finish = t.finish
            messages.append({"role": "assistant", "content": t.text})
        e2e = time.perf_counter() - t0
        return Measurement(ids_all, "\n\n".join(texts), finish, prompt_tokens, ttft, decode, dtok, e2e,
                           steps, accepted, tree, lengths)


class EngineMode(Mode):
    """A mode run by the engine (ar, chain, tree-N, bastion)."""

    def __init__(self, name: str, target: Target, engine: Engine):
        super().__init__(name, target)
        self.engine = engine

    def controller_snapshot(self) -> dict | None:
        """The adaptive controller's `snapshot()` (None for the fixed modes)."""
        snap = getattr(self.engine.controller, "snapshot", None)
        return snap() if callable(snap) else None

    def _turn(self, prompt_ids: list[int], params: SamplingParams) -> _Turn:
        dev = self.target.model.device
        ids: list[int] = []
        text: list[str] = []
        steps = accepted = tree = 0
        finish = "stop"
        t0 = time.perf_counter()
        t_first = None
        first_n = 0
        for ev in self.engine.stream(prompt_ids, params):
            if t_first is None:
                _sync(dev)
                t_first = time.perf_counter()
                first_n = len(ev.token_ids)
            ids.extend(ev.token_ids)
            text.append(ev.text)
            if ev.step is not None:
                steps += 1
                accepted += ev.step.accepted
                tree += ev.step.tree_size
            if ev.finish_reason:
                finish = ev.finish_reason
        _sync(dev)
        t_end = time.perf_counter()
        t_first = t_first or t_end
        return _Turn(ids, "".join(text), finish, t_first - t0, t_end - t_first, max(0, len(ids) - first_n),
                     steps, accepted, tree)


class _Clock:
    """A transformers streamer that only timestamps: the prompt, then the tokens of each step."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


class HFMode(Mode):
    """transformers `generate` on the same loaded model: plain (ar-hf) or prompt lookup (pld)."""

    def __init__(self, name: str, target: Target, prompt_lookup: int | None = None):
        super().__init__(name, target)
        self.prompt_lookup = prompt_lookup
        self.eos = target.eos_token_ids

    def _turn(self, prompt_ids: list[int], params: SamplingParams) -> _Turn:
        from transformers import GenerationConfig

        model = self.target.model
        dev = model.device
        sample = not params.greedy
        eos = sorted(self.eos) if not params.ignore_eos else []
        gc = GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=sample, num_beams=1,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None, top_k=(params.top_k or None) if sample else None,
            eos_token_id=eos or None, pad_token_id=(eos[0] if eos else 0),
            prompt_lookup_num_tokens=self.prompt_lookup,
        )
        if sample and params.seed is not None:
            torch.manual_seed(int(params.seed))
        inp = torch.tensor([prompt_ids], device=dev)
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inp, attention_mask=torch.ones_like(inp), generation_config=gc, streamer=clock)
        _sync(dev)
        t_end = time.perf_counter()
        new = out[0, len(prompt_ids):].tolist()
        finish = "length"
        for i, t in enumerate(new):
            if t in self.eos and not params.ignore_eos:
                new, finish = new[:i], "stop"
                break
        steps_ = clock.puts[1:]  # puts[0] is the prompt
        if not steps_:
            return _Turn(new, self._decode(new), finish, t_end - t0, 0.0, 0, 0, 0, 0)
        t_first, first_n = steps_[0]
        rest = steps_[1:]
        # tokens per decode step, counting only kept tokens (EOS and what follows it are not output)
        kept_after_first = max(0, len(new) - first_n)
        tree = None if self.prompt_lookup else len(rest)
        return _Turn(new, self._decode(new), finish, t_first - t0, t_end - t_first, kept_after_first,
                     len(rest), kept_after_first, tree)

    def _decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)


# ---- mode names ---------------------------------------------------------------------------

_TREE = re.compile(r"^tree-(\d+)$")


def expand_modes(names: list[str], budgets: list[int]) -> list[str]:
    """Validate mode names and expand "tree" to tree-N per budget; keeps order, drops repeats.

    Raises ValueError naming an unknown mode or a budget < 1.
    """
    out: list[str] = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        if name == "tree":
            items = [f"tree-{b}" for b in budgets]
        elif name in BASE_MODES or _TREE.match(name):
            items = [name]
        else:
            raise ValueError(f"unknown mode '{raw}' (choose from {', '.join(BASE_MODES)} or tree-N)")
        for it in items:
            m = _TREE.match(it)
            if m and int(m.group(1)) < 1:
                raise ValueError(f"tree budget must be >= 1, got '{it}'")
            if it not in out:
                out.append(it)
    if not out:
        raise ValueError("no modes selected")
    return out


def needs_drafter(mode: str) -> bool:
    return mode in SPECULATIVE or bool(_TREE.match(mode))


def build_modes(names: list[str], target: Target, drafter: Drafter | None,
                bastion_controller: Callable[[], object] | None = None) -> list[Mode]:
    """Mode objects for `names` (already expanded); speculative names need `drafter`.

    bastion_controller(surrogate_correction=bool): builds the adaptive controller (calibration)
    for 'bastion' (per-depth surrogate correction on, as served) and 'bastion-raw' (off).
    Raises ValueError for a speculative mode without a drafter or 'bastion' without a factory.
    """
    modes: list[Mode] = []
    for name in names:
        if needs_drafter(name) and drafter is None:
            raise ValueError(f"mode '{name}' needs a drafter")
        if name == "ar-hf":
            modes.append(HFMode(name, target))
        elif name == "pld":
            modes.append(HFMode(name, target, prompt_lookup=PLD_TOKENS))
        elif name == "ar":
            modes.append(EngineMode(name, target, Engine(target, None, make_controller("ar"))))
        elif name == "chain":
            modes.append(EngineMode(name, target, Engine(target, drafter, make_controller(
                "chain", block_size=drafter.max_depth + 1))))
        elif name in ("bastion", "bastion-raw"):
            if bastion_controller is None:
                raise ValueError(f"mode '{name}' needs a controller factory")
            controller = bastion_controller(surrogate_correction=name == "bastion")
            modes.append(EngineMode(name, target, Engine(target, drafter, controller)))
        else:
            budget = int(_TREE.match(name).group(1))
            modes.append(EngineMode(name, target, Engine(target, drafter, make_controller("tree", budget))))
    return modes
