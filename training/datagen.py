"""Training data for the drafter: the target's own greedy responses, with its features, fast.

`greedy_batch` decodes a batch of chat prompts with a preallocated static KV cache
(left padding, one explicit 4-D mask, no cache concatenation), and captures on the
way, for free, what training needs from the target:

* `features`: hidden states at the drafter's feature layers (HF index, 0 = embeddings),
  concatenated, for every token the target consumed (prompt from the prefill, each
  response token from the decode step that fed it) -> [T-1, n_layers * H] bfloat16;
* `top_ids` / `top_lp`: the target's top-k next-token log-probabilities at every
  response-predicting position (prompt_len-1 .. T-2) for soft-label distillation.

So the separate teacher-forced feature pass is not needed (docs/drafter.md has the
measurements). `write_shards` runs it over a prompt list, one shard file per batch,
skipping shards already written, so the stage resumes after any interruption.
"""
from __future__ import annotations

import inspect
import json
import logging
import time
from pathlib import Path

import torch
from transformers import StaticCache

log = logging.getLogger(__name__)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The target's chat template with the generation prompt -> token ids."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new: int, eos: set[int], feature_layers: tuple[int, ...],
                 top_k: int = 8) -> list[dict]:
    """Greedy-decode `prompts` together; return one record per prompt.

    Record: ids int32 [T] (prompt + response, EOS included when reached), prompt_len,
    features bf16 [T-1, len(feature_layers)*H], top_ids int32 / top_lp float16
    [T-prompt_len, top_k] (the target's top-k at positions prompt_len-1 .. T-2).
    """
    dev = model.device
    b = len(prompts)
    P = max(len(p) for p in prompts)
    L = P + max_new
    pads = torch.tensor([P - len(p) for p in prompts], device=dev)
    ids = torch.zeros((b, P), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, device=dev)
    cache = StaticCache(config=model.config, max_cache_len=L)
    keys = torch.arange(L, device=dev)
    valid = keys[None, :] >= pads[:, None]  # [b, L] key slot holds a real token (once written)
    neg = torch.finfo(model.dtype).min
    ckw = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"

    def mask_for(q_pos: torch.Tensor) -> torch.Tensor:
        """Additive [b, 1, q, L] mask: key k visible when valid and k <= query slot."""
        m = valid[:, None, None, :] & (keys[None, None, None, :] <= q_pos[None, None, :, None])
        return torch.zeros(m.shape, dtype=model.dtype, device=dev).masked_fill_(~m, neg)

    pos = (torch.arange(P, device=dev)[None, :] - pads[:, None]).clamp_(min=0)
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask_for(torch.arange(P, device=dev)),
                cache_position=torch.arange(P, device=dev), use_cache=True,
                output_hidden_states=True, logits_to_keep=1, **{ckw: cache})
    feats = [torch.cat([out.hidden_states[l] for l in feature_layers], dim=-1).to(torch.bfloat16).cpu()]
    lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
    tops = [torch.topk(lp, top_k, dim=-1)]
    nxt = lp.argmax(-1)
    toks = [nxt.cpu()]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos_t = torch.tensor(sorted(eos) or [-1], device=dev)
    done |= torch.isin(nxt, eos_t)
    lens = torch.full((b,), max_new, dtype=torch.long)  # response length incl. EOS
    lens[done.cpu()] = 1
    for t in range(1, max_new):
        if bool(done.all()):
            break
        slot = torch.tensor([P + t - 1], device=dev)
        out = model(input_ids=nxt[:, None], position_ids=(P + t - 1 - pads)[:, None], attention_mask=mask_for(slot),
                    cache_position=slot, use_cache=True, output_hidden_states=True, **{ckw: cache})
        feats.append(torch.cat([out.hidden_states[l] for l in feature_layers], dim=-1).to(torch.bfloat16).cpu())
        lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        tops.append(torch.topk(lp, top_k, dim=-1))
        nxt = lp.argmax(-1)
        toks.append(nxt.cpu())
        fin = torch.isin(nxt, eos_t) & ~done
        lens[fin.cpu()] = t + 1
        done |= fin
    gen = torch.stack(toks, dim=1)  # [b, n]
    F = torch.cat(feats, dim=1)  # [b, P + n - 1, D]
    top_ids = torch.stack([t.indices for t in tops], dim=1).int().cpu()
    top_lp = torch.stack([t.values for t in tops], dim=1).half().cpu()
    recs = []
    for i, p in enumerate(prompts):
        n = int(lens[i])
        pl = len(p)
        seq = torch.cat([torch.tensor(p, dtype=torch.int32), gen[i, :n].int()])
        f = F[i, P - pl: P + n - 1].clone()  # features of positions 0 .. T-2
        recs.append({"ids": seq, "prompt_len": pl, "features": f,
                     "top_ids": top_ids[i, :n].clone(), "top_lp": top_lp[i, :n].clone()})
    return recs


def write_shards(model, tokenizer, prompts: list[dict], out_dir: Path, feature_layers: tuple[int, ...],
                 shard_size: int = 64, max_new: int = 256, max_prompt: int = 192, top_k: int = 8,
                 eos: set[int] | None = None, progress=None) -> dict:
    """Generate every shard of `prompts` not yet on disk; return totals.

    Shard i holds prompts[i*shard_size:(i+1)*shard_size] as `shard_{i:05d}.pt` (a list of
    `greedy_batch` records plus prompt ids); progress lines go to `out_dir/progress.jsonl`.
    Prompts are sorted by length inside a shard so left padding stays small.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = eos if eos is not None else {tokenizer.eos_token_id}
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    total_tok = 0
    for s in range(n_shards):
        path = out_dir / f"shard_{s:05d}.pt"
        if path.exists():
            continue
        rows = prompts[s * shard_size:(s + 1) * shard_size]
        enc = [(r, chat_ids(tokenizer, r["prompt"])[-max_prompt:]) for r in rows]
        enc.sort(key=lambda x: len(x[1]))
        t0 = time.perf_counter()
        recs = greedy_batch(model, [e[1] for e in enc], max_new, eos, feature_layers, top_k)
        dt = time.perf_counter() - t0
        for (r, _), rec in zip(enc, recs):
            rec["prompt_id"] = r.get("id")
            rec["kind"] = r.get("kind")
        tmp = path.with_suffix(".tmp")
        torch.save(recs, tmp)
        tmp.rename(path)
        ntok = sum(len(r["ids"]) - r["prompt_len"] for r in recs)
        total_tok += ntok
        line = {"shard": s, "seqs": len(recs), "response_tokens": ntok, "seconds": round(dt, 2),
                "tok_per_s": round(ntok / dt, 1), "time": time.time()}
        with open(out_dir / "progress.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if progress:
            progress(line)
    return {"shards": n_shards, "new_tokens": total_tok}
