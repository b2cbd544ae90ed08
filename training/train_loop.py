"""The train stage: data loading, AdamW + warm-up/cosine, checkpoints, loss log, tau evaluation, export.

Folder `out/train/`:
    ckpt.pt        model + optimiser + step + data/time counters (resume point, written atomically)
    loss.jsonl     one line per `log_every` steps (loss, hard/soft parts, acc@1, estimated tau, lr, blocks/s)
    eval.jsonl     one line per evaluation: real speculative decoding through engine.Engine, chain and
                   32-node tree, greedy, on held-out validation prompts -> tau
    best/          the exported drafter (config.json + model.safetensors) with the best tree tau so far
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from drafting.dflash import save_dflash
from training.train import DrafterTrainer, TrainConfig, frequent_vocab, lr_at, make_batch, to_drafter, token_counts


class ShardData:
    """All finished shards of a data folder in memory; `refresh()` picks up new shards."""

    def __init__(self, folder: Path, vocab_size: int = 0, min_response: int = 2):
        self.folder = Path(folder)
        self.vocab_size = vocab_size
        self.min_response = min_response
        self.loaded: set[str] = set()
        self.seqs: list[dict] = []
        self.tokens = 0
        self.counts = None  # token_counts over all loaded sequences

    def refresh(self) -> int:
        new = 0
        for p in sorted(self.folder.glob("shard_*.pt")):
            if p.name in self.loaded:
                continue
            recs = [r for r in torch.load(p, weights_only=False) if len(r["ids"]) - r["prompt_len"] >= self.min_response]
            if recs and self.vocab_size:
                c = token_counts(recs, self.vocab_size)
                self.counts = c if self.counts is None else self.counts + c
            for r in recs:
                self.seqs.append(r)
                self.tokens += len(r["ids"]) - r["prompt_len"]
            self.loaded.add(p.name)
            new += 1
        return new


def validation_prompts(n: int, train_texts: set[str], seed: int = 777) -> list[str]:
    """`n` held-out prompts: a different seed of training_prompts, minus any training prompt text."""
    from training.prompts import training_prompts

    rows = training_prompts(max(4 * n, 60), seed=seed)
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = [r["prompt"] for r in rows if r["prompt"] not in train_texts]
    return out[:n]


@torch.no_grad()
def evaluate_tau(target, trainer: DrafterTrainer, prompts: list[str], max_tokens: int,
                 modes=(("chain", 0), ("tree", 32))) -> dict:
    """Greedy speculative decoding with the current weights; mean tau per mode (all steps pooled)."""
    from engine.engine import Engine, make_controller
    from engine.sampling import SamplingParams

    drafter = to_drafter(trainer, target.model)
    res = {}
    for mode, budget in modes:
        eng = Engine(target, drafter, make_controller(mode, budget or 32, drafter.max_depth + 1))
        acc = steps = 0
        t0 = time.perf_counter()
        for p in prompts:
            ids = eng.chat_prompt_ids([{"role": "user", "content": p}])
            r = eng.generate(ids, SamplingParams(max_tokens=max_tokens))
            acc += sum(s.accepted for s in r.steps)
            steps += len(r.steps)
        key = mode if mode == "chain" else f"tree{budget}"
        res[key] = acc / max(1, steps)
        res[f"{key}_s"] = round(time.perf_counter() - t0, 1)
    return res


def export(trainer: DrafterTrainer, path: Path, dtype=torch.bfloat16) -> None:
    """Write the drafter in the published format (+ extensions), weights cast to `dtype`."""
    import copy

    m = copy.deepcopy(trainer.model).to(dtype)
    if m.d2t is not None:
        m.d2t = trainer.model.d2t.long()
    tmp = Path(str(path) + ".tmp")
    save_dflash(m, tmp)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)


def save_ckpt(path: Path, trainer: DrafterTrainer, opt, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": trainer.model.state_dict(), "opt": opt.state_dict(), "cfg": trainer.cfg.to_dict(),
                "state": state}, tmp)
    tmp.rename(path)


def build(target_model, cfg: TrainConfig, data: ShardData | None, ckpt: dict | None):
    """Trainer + optimiser, restored from `ckpt` when given (its d2t and config win)."""
    d2t = None
    if ckpt is not None:
        cfg = TrainConfig.from_dict(ckpt["cfg"])
        if "d2t" in ckpt["model"]:
            d2t = ckpt["model"]["d2t"]
    elif cfg.draft_vocab:
        d2t = vocab_from(data, target_model.config.vocab_size, cfg.draft_vocab)
    trainer = DrafterTrainer(target_model, cfg, d2t)
    opt = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=cfg.lr,
                            betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if ckpt is not None:
        trainer.model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    return trainer, opt


def vocab_from(data: ShardData, vocab_size: int, size: int) -> torch.Tensor:
    """The reduced vocabulary for the data loaded so far."""
    return frequent_vocab(data.seqs, vocab_size, size, data.counts)


def train_step(trainer: DrafterTrainer, opt, batch: dict, step: int) -> dict:
    """One AdamW step under bfloat16 autocast with gradient clipping; returns float metrics."""
    cfg = trainer.cfg
    for g in opt.param_groups:
        g["lr"] = lr_at(step, cfg)
    trainer.model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
        out = trainer(batch)
    opt.zero_grad(set_to_none=True)
    out["loss"].backward()
    gn = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.grad_clip)
    opt.step()
    m = {k: float(v.detach()) for k, v in out.items()}
    m["grad_norm"] = float(gn)
    m["lr"] = opt.param_groups[0]["lr"]
    return m


def config_from_args(args) -> TrainConfig:
    return TrainConfig(block_size=args.block_size, num_layers=args.layers, draft_vocab=args.draft_vocab,
                       inject_anchor=not args.no_inject, soft_weight=args.soft_weight, lr=args.lr, steps=args.steps,
                       batch=args.batch, blocks=args.blocks)


def train_stage(args, out: Path, log, target=None) -> None:
    """Train until `args.steps` (the cosine horizon; may be raised on resume) or `args.minutes`.

    target: a loaded engine.loader.Target (default: the embedded target in bfloat16, as shipped).
    """
    from engine.loader import load_target

    tdir = out / "train"
    tdir.mkdir(parents=True, exist_ok=True)
    if target is None:
        target = load_target(None, "bfloat16")  # evaluation runs the engine as shipped (bf16)
    data = ShardData(out / "data", target.config.vocab_size)
    while data.refresh() < args.wait_data and len(data.loaded) < args.wait_data:
        log.info("train: waiting for data shards (%d so far)", len(data.loaded))
        time.sleep(60)
    log.info("train: %d sequences, %d response tokens", len(data.seqs), data.tokens)
    ckpt_path = tdir / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if ckpt_path.exists() else None
    cfg = config_from_args(args)
    trainer, opt = build(target.model, cfg, data, ckpt)
    cfg = trainer.cfg
    if cfg.draft_vocab:  # re-chosen from all data loaded now (the weights do not depend on it)
        trainer.set_vocab(vocab_from(data, target.config.vocab_size, cfg.draft_vocab))
    cfg.steps = args.steps  # the horizon may grow when training continues
    state = ckpt["state"] if ckpt else {"step": 0, "train_s": 0.0, "blocks": 0, "best_tau": 0.0, "evals": 0}
    if ckpt is None and args.init:
        from drafting.dflash import load_dflash

        init = load_dflash(args.init, target.model).model
        trainer.model.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
        log.info("train: initialised from %s", args.init)
    log.info("train: %s from step %d (%.1f min trained), cfg %s", "resumed" if ckpt else "started", state["step"],
             state["train_s"] / 60, cfg.to_dict())
    val = []
    if args.eval_prompts:
        train_texts = {json.loads(line)["prompt"] for line in open(out / "prompts.jsonl")}
        val = validation_prompts(args.eval_prompts, train_texts)
    gen = torch.Generator().manual_seed(cfg.seed + state["step"])
    rng = random.Random(cfg.seed + state["step"])
    t_start = time.time()
    last_ckpt = last_eval = time.time()
    if state["step"] == 0 or state.get("evals", 0) == 0:
        last_eval = 0.0  # evaluate the starting point once
    agg, n_agg, t_log = {}, 0, time.perf_counter()
    while state["step"] < cfg.steps:
        if args.minutes and time.time() - t_start > args.minutes * 60:
            break
        if val and time.time() - last_eval > args.eval_minutes * 60:
            ev = evaluate_tau(target, trainer, val, args.eval_tokens)
            ev.update(step=state["step"], train_h=round(state["train_s"] / 3600, 4), blocks=state["blocks"],
                      data_tokens=data.tokens, time=time.time())
            with open(tdir / "eval.jsonl", "a") as fh:
                fh.write(json.dumps(ev) + "\n")
            log.info("eval step %d: chain tau %.3f, tree32 tau %.3f", state["step"], ev["chain"], ev["tree32"])
            state["evals"] = state.get("evals", 0) + 1
            if ev["tree32"] > state["best_tau"]:
                state["best_tau"] = ev["tree32"]
                export(trainer, tdir / "best")
                (tdir / "best" / "eval.json").write_text(json.dumps(ev))
                if args.ship:
                    export(trainer, Path(args.ship))
                log.info("eval: new best, exported")
            last_eval = time.time()
        if state["step"] % 200 == 0 and data.refresh():
            if cfg.draft_vocab:
                trainer.set_vocab(vocab_from(data, target.config.vocab_size, cfg.draft_vocab))
            log.info("train: data now %d sequences, %d response tokens", len(data.seqs), data.tokens)
        seqs = rng.sample(data.seqs, min(cfg.batch, len(data.seqs)))
        batch = make_batch(seqs, cfg, gen, soft=cfg.soft_weight > 0)
        t0 = time.perf_counter()
        m = train_step(trainer, opt, batch, state["step"])
        state["train_s"] += time.perf_counter() - t0
        state["step"] += 1
        state["blocks"] += int(batch["valid"].sum())
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + v
        n_agg += 1
        if state["step"] % 25 == 0:
            dt = time.perf_counter() - t_log
            line = {k: round(v / n_agg, 5) for k, v in agg.items()}
            line.update(step=state["step"], train_h=round(state["train_s"] / 3600, 4), blocks=state["blocks"],
                        blocks_per_s=round(n_agg * cfg.batch * cfg.blocks / dt, 1), data_tokens=data.tokens,
                        time=time.time())
            with open(tdir / "loss.jsonl", "a") as fh:
                fh.write(json.dumps(line) + "\n")
            log.info("step %d loss %.3f acc1 %.3f est_tau %.3f lr %.2e %.0f blocks/s", state["step"], line["loss"],
                     line["acc1"], line["est_tau"], line["lr"], line["blocks_per_s"])
            agg, n_agg, t_log = {}, 0, time.perf_counter()
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt(ckpt_path, trainer, opt, state)
            last_ckpt = time.time()
    save_ckpt(ckpt_path, trainer, opt, state)
    log.info("train: stopped at step %d (%.1f min trained)", state["step"], state["train_s"] / 60)
