"""The data stage: prompts from two sources, the target's greedy answers, token shards in git.

Each shard holds `shard_prompts` sequences, half from each source:

* ``template``: `training.prompts.training_prompts` (chat, code and math templates), one
  fixed list of `TEMPLATE_POOL` prompts sliced shard by shard;
* ``magpie``: user turns the target writes itself when given only its chat template's
  user prefix (Magpie, arXiv 2406.08464), sampled at temperature 1 with top-p 0.95,
  filtered (ended with EOS, 3..150 words, mostly printable ASCII), deduplicated against
  every prompt already in the folder, and checked for OVERLAP_SPAN-word overlap with every
  benchmark prompt.

Responses are the target's greedy decoding (`training.generate.decode_many`) of the chat
prompt, up to `max_new` tokens. `build_shards` appends shards until the folder holds
`response_tokens` response tokens (or `max_shards` new shards), so a stopped run resumes
by running the same command: shard k always takes template prompts [k*h, (k+1)*h) and the
magpie sampler is seeded by k.
"""
from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Callable

import torch

from engine.sampling import SamplingParams
from training.features import FeatureStore, store_key
from training.generate import decode_many
from training.prompts import OVERLAP_SPAN, _span_index, default_benchmark_texts, normalized_words, training_prompts, \
    word_spans
from training.shards import Sequence, read_all, read_manifest, write_shard

log = logging.getLogger(__name__)

#: Size of the fixed template prompt list shards slice (enough for 2 x TEMPLATE_POOL responses).
TEMPLATE_POOL = 16000
MAGPIE_PARAMS = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=128)
_SENTINEL = "QXQXSENTINELQXQX"


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The target's chat template for one user turn, with the generation prompt -> token ids."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user turn's text begins (Magpie's prompt).

    Raises ValueError when the template does not render the user text verbatim.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise ValueError("the chat template does not render the user's text verbatim")
    return list(tokenizer(text[:text.index(_SENTINEL)], add_special_tokens=False)["input_ids"])


def prompt_key(text: str) -> str:
    """Deduplication key: lower-case words without punctuation."""
    return " ".join(normalized_words(text))


def acceptable_user_turn(text: str) -> bool:
    """Filter for a sampled user turn: 3..150 words, >= 95 % printable ASCII, no template markers."""
    words = text.split()
    if not 3 <= len(words) <= 150 or "<|" in text:
        return False
    printable = sum(1 for ch in text if 32 <= ord(ch) < 127 or ch in "\n\t")
    return printable >= 0.95 * len(text)


def magpie_prompts(fw, tokenizer, eos: set[int], n: int, seed: int, seen: set[str], benchmark_index: set,
                   slots: int = 64, oversample: float = 1.6) -> list[str]:
    """Up to `n` new user turns written by the target (see the module docstring).

    seen: dedup keys of prompts already used (updated in place). benchmark_index: the
    OVERLAP_SPAN-word spans of the benchmark prompts (training.prompts._span_index).
    """
    prefix = user_prefix_ids(tokenizer)
    gen = torch.Generator(device=fw.device).manual_seed(1_000_003 * seed + 17)
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 4:
        tries += 1
        m = int((n - len(out)) * oversample) + 8
        for d in decode_many(fw, [prefix] * m, MAGPIE_PARAMS.max_tokens, eos, MAGPIE_PARAMS, slots=slots,
                             generator=gen):
            if not d.ended:
                continue
            text = tokenizer.decode(d.response, skip_special_tokens=True).strip()
            key = prompt_key(text)
            if not acceptable_user_turn(text) or key in seen or not benchmark_index.isdisjoint(word_spans(text)):
                continue
            seen.add(key)
            out.append(text)
            if len(out) == n:
                break
    return out


def folder_prompt_texts(folder: Path, tokenizer) -> list[str]:
    """The user-turn text of every sequence in a data folder (decoded from its prompt ids)."""
    prefix = len(user_prefix_ids(tokenizer))
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    tail = len(tokenizer(text[text.index(_SENTINEL) + len(_SENTINEL):], add_special_tokens=False)["input_ids"])
    return [tokenizer.decode(s.ids[prefix:s.prompt_len - tail].tolist(), skip_special_tokens=True).strip()
            for s in read_all(folder, verify=False)]


def build_shards(folder: Path, target, fw, response_tokens: int, shard_prompts: int = 512, max_new: int = 256,
                 max_prompt: int = 384, slots: int = 64, max_shards: int = 0, target_id: str = "smollm2",
                 feature_cache: Path | None = None, feature_layers: tuple[int, ...] = (), top_k: int = 8,
                 progress: Callable[[dict], None] | None = None) -> dict:
    """Append shards to `folder` until it holds `response_tokens` response tokens.

    target: an engine.loader.Target (tokenizer, EOS ids); fw: its TargetForward.
    max_shards: stop after this many new shards (0: no limit). feature_cache, feature_layers,
    top_k: also store the features and top-k captured while decoding in the cache the train
    stage reads (training.features.FeatureStore), so this machine never runs the
    teacher-forced pass for its own shards. Returns the manifest.
    """
    tok = target.tokenizer
    eos = target.eos_token_ids
    half = shard_prompts // 2
    bench = _span_index(default_benchmark_texts(), OVERLAP_SPAN)
    templates = training_prompts(TEMPLATE_POOL, seed=0)
    seen = {prompt_key(t) for t in folder_prompt_texts(folder, tok)} | {prompt_key(r["prompt"]) for r in templates}
    made = 0
    while True:
        man = read_manifest(folder)
        have = sum(s["response_tokens"] for s in man["shards"])
        if have >= response_tokens or (max_shards and made >= max_shards):
            return man
        k = len(man["shards"])
        t0 = time.perf_counter()
        rows = [("template", r["prompt"]) for r in templates[k * half:(k + 1) * half]]
        t_magpie = time.perf_counter()
        rows += [("magpie", p) for p in magpie_prompts(fw, tok, eos, shard_prompts - len(rows), k, seen, bench,
                                                       slots=slots)]
        t_magpie = time.perf_counter() - t_magpie
        enc = [(src, chat_ids(tok, p)) for src, p in rows]
        enc = [(src, ids) for src, ids in enc if len(ids) <= max_prompt]
        random.Random(k).shuffle(enc)
        t_resp = time.perf_counter()
        capture = feature_cache is not None and bool(feature_layers)
        outs = decode_many(fw, [ids for _, ids in enc], max_new, eos, slots=slots,
                           feature_layers=feature_layers if capture else (), top_k=top_k if capture else 0)
        t_resp = time.perf_counter() - t_resp
        seqs = [Sequence(torch.tensor(ids + d.response).numpy(), len(ids), src, d.ended)
                for (src, ids), d in zip(enc, outs)]
        n_resp = sum(len(d.response) for d in outs)
        entry = write_shard(folder, seqs, target_id, meta={
            "generator": "greedy", "dtype": str(fw.dtype).replace("torch.", ""), "max_new": max_new,
            "seconds": round(time.perf_counter() - t0, 1), "magpie_seconds": round(t_magpie, 1),
            "response_tok_per_s": round(n_resp / t_resp, 1), "threads": torch.get_num_threads()})
        if capture:
            width = outs[0].features.shape[-1]
            store = FeatureStore(feature_cache, store_key(entry["sha256"], feature_layers, top_k, fw.dtype, width),
                                 [len(q.ids) for q in seqs], [q.prompt_len for q in seqs], width, top_k)
            for j, d in enumerate(outs):
                store.put(j, {"features": d.features, "top_ids": d.top_ids, "top_lp": d.top_lp})
        made += 1
        if progress:
            progress(entry)
