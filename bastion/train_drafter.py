"""`bastion train-drafter`: resumable stages prompts -> data -> train, all under one output folder.

    runs/drafter/prompts.jsonl          stage prompts (training.prompts.training_prompts)
    runs/drafter/data/shard_*.pt        stage data: target responses + features + top-k (training.datagen)
    runs/drafter/train/                 stage train: ckpt.pt, loss.jsonl, eval.jsonl, best/ (training.train_loop)

Each stage skips what is already on disk, so rerunning the same command resumes.
Stages can run as separate processes (data keeps growing while train re-reads new shards).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

STAGES = ("prompts", "data", "train")


def add_arguments(parser) -> None:
    from bastion.settings import env_default

    parser.add_argument("--out", default="runs/drafter", help="output folder (default runs/drafter)")
    parser.add_argument("--stages", default="prompts,data,train", help="comma-separated subset of prompts,data,train")
    parser.add_argument("--threads", type=int, default=env_default("threads", "1"),
                        help="torch CPU threads (default $BASTION_THREADS or 1: leave the shared cores to others)")
    parser.add_argument("--n-prompts", type=int, default=8000, help="training prompts to generate responses for")
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--data-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="target dtype for generation (float32 is faster on CPUs without AMX)")
    parser.add_argument("--gen-batch", type=int, default=128, help="prompts decoded together (one shard)")
    parser.add_argument("--max-new", type=int, default=256, help="response tokens per prompt")
    parser.add_argument("--top-k", type=int, default=8, help="target log-probs kept per position (soft labels)")
    parser.add_argument("--max-shards", type=int, default=0, help="stop the data stage after this many shards (0: all)")
    # train
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="reduced output vocabulary (0: full)")
    parser.add_argument("--no-inject", action="store_true", help="disable the anchor-feature injection")
    parser.add_argument("--soft-weight", type=float, default=0.5, help="share of the soft-label distillation loss")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--steps", type=int, default=20000, help="cosine schedule horizon (steps)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--blocks", type=int, default=16, help="anchors per sequence per step")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop training after this many minutes (0: run to --steps)")
    parser.add_argument("--ckpt-minutes", type=float, default=5.0, help="checkpoint every this many minutes")
    parser.add_argument("--eval-minutes", type=float, default=15.0, help="speculative-decoding eval every this many minutes")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out validation prompts per eval")
    parser.add_argument("--eval-tokens", type=int, default=64, help="new tokens per eval prompt")
    parser.add_argument("--ship", default="", help="also export every best-tau checkpoint to this folder")
    parser.add_argument("--init", default="", help="initialise from this exported drafter when no ckpt.pt exists")
    parser.add_argument("--wait-data", type=int, default=1, help="minimum shards before training starts")


def _log(out: Path, name: str):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(out / f"{name}.log"), logging.StreamHandler(sys.stderr)], force=True)
    return logging.getLogger(f"bastion.train.{name}")


def stage_prompts(args, out: Path) -> Path:
    from training.prompts import training_prompts

    path = out / "prompts.jsonl"
    if path.exists() and sum(1 for _ in open(path)) >= args.n_prompts:
        return path
    rows = training_prompts(args.n_prompts, seed=args.prompt_seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    tmp.rename(path)
    return path


def stage_data(args, out: Path, log) -> None:
    import torch

    from training.datagen import write_shards
    from engine.loader import load_target

    rows = [json.loads(line) for line in open(out / "prompts.jsonl")]
    if args.max_shards:
        rows = rows[: args.max_shards * args.gen_batch]
    target = load_target(None, args.data_dtype)
    layers = tuple(i + 1 for i in _layer_ids(target.config))
    meta = out / "data" / "meta.json"
    meta.parent.mkdir(parents=True, exist_ok=True)
    if meta.exists():
        old = json.loads(meta.read_text())
        if tuple(old["feature_layers"]) != layers:
            raise SystemExit(f"{meta} was written with feature layers {old['feature_layers']}, not {list(layers)}")
    else:
        meta.write_text(json.dumps({"feature_layers": list(layers), "dtype": args.data_dtype, "max_new": args.max_new,
                                    "top_k": args.top_k, "prompts": str(out / "prompts.jsonl")}))
    log.info("data: %d prompts, batch %d, %s, threads %d", len(rows), args.gen_batch, args.data_dtype,
             torch.get_num_threads())
    res = write_shards(target.model, target.tokenizer, rows, out / "data", layers, shard_size=args.gen_batch,
                       max_new=args.max_new, top_k=args.top_k, eos=target.eos_token_ids,
                       progress=lambda d: log.info("shard %(shard)d: %(seqs)d seqs, %(response_tokens)d tokens, "
                                                   "%(seconds).0f s, %(tok_per_s).0f tok/s", d))
    log.info("data done: %s", res)


def _layer_ids(target_config) -> list[int]:
    from training.train import TrainConfig

    n = int(target_config.num_hidden_layers)
    ids = list(TrainConfig.target_layer_ids)
    if max(ids) >= n:  # another target: spread three layers evenly (the default rule, docs/method.md, section 2)
        from drafting.dflash import default_target_layer_ids

        ids = default_target_layer_ids(n, 3)
    return ids


def run(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, args.threads))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"unknown stage(s) {bad}; choose from {STAGES}", file=sys.stderr)
        return 2
    log = _log(out, "_".join(stages))
    t0 = time.time()
    if "prompts" in stages:
        p = stage_prompts(args, out)
        log.info("prompts: %s", p)
    if "data" in stages:
        stage_data(args, out, log)
    if "train" in stages:
        from training.train_loop import train_stage

        train_stage(args, out, log)
    log.info("done in %.0f s", time.time() - t0)
    return 0
