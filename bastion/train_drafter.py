"""`bastion train-drafter`: resumable stages data -> train, and export of the newest state.

    data/drafter/                       stage data: token shards + manifest, committed (training.datagen)
    data/drafter-train/                 stage train: compact resumable state + loss.jsonl + eval.jsonl,
                                        committed (training.train_loop)
    runs/drafter/train/                 stage train, local: ckpt.pt (exact resume point), best/
    runs/drafter/latest/                stage export (--export-dir): the newest state as a drafter folder
    $BASTION_CACHE/drafter-features/    the target's features for the shards, computed on first use

Each stage continues from what is on disk, so rerunning the same command resumes, on this
machine or on a new clone. Stages can run as separate processes (train re-reads new shards).
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

STAGES = ("data", "train", "export")


def add_arguments(parser) -> None:
    from bastion.settings import env_default
    from training.shards import DEFAULT_DATA_DIR

    parser.add_argument("--out", default="runs/drafter", help="output folder (default runs/drafter)")
    parser.add_argument("--stages", default="data,train", help="comma-separated subset of data,train,export (export: write the newest "
                             "training state as a drafter folder to --export-dir)")
    parser.add_argument("--threads", type=int, default=env_default("threads", "0"),
                        help="torch CPU threads (default $BASTION_THREADS or 0: every core; a training job "
                             "should have the machine to itself)")
    parser.add_argument("--data-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the target's dtype for generation, features and evaluation (auto: the data "
                             "stage times its own batched decoding in both and keeps the faster; the train "
                             "stage takes the dtype most shards were generated in)")
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR),
                        help="token shards (committed; default data/drafter in the repository)")
    parser.add_argument("--response-tokens", type=int, default=2_000_000,
                        help="the data stage adds shards until the folder holds this many response tokens")
    parser.add_argument("--shard-prompts", type=int, default=512, help="prompts per shard (half template, half magpie)")
    parser.add_argument("--gen-slots", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--max-new", type=int, default=256, help="response tokens per prompt")
    parser.add_argument("--top-k", type=int, default=8, help="target log-probs kept per position (soft labels)")
    parser.add_argument("--state-dir", default=str(DEFAULT_DATA_DIR.parent / "drafter-train"),
                        help="compact resumable training state and learning-curve logs (committed; "
                             "default data/drafter-train)")
    parser.add_argument("--feature-cache", default="",
                        help="folder for the target's cached features (default $BASTION_CACHE/drafter-features)")
    parser.add_argument("--max-shards", type=int, default=0, help="stop the data stage after this many new shards "
                                                                  "(0: until --response-tokens)")
    # train
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="drafter layers (2: the ablation in docs/drafter.md)")
    parser.add_argument("--feature-layers", type=int, default=3,
                        help="target layers the drafter reads (3: [1, 14, 27]; other counts spread evenly)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="reduced output vocabulary (0: full)")
    parser.add_argument("--no-inject", action="store_true", help="disable the anchor-feature injection")
    parser.add_argument("--soft-weight", type=float, default=0.5, help="share of the soft-label distillation loss")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--steps", type=int, default=20000, help="cosine schedule horizon (steps)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--blocks", type=int, default=16, help="anchors per sequence per step")
    parser.add_argument("--echo", type=int, default=1,
                        help="train on a batch whose features had to be computed this many steps in a row, "
                             "anchors re-drawn each time (data echoing: on a machine without the feature cache "
                             "the target's forward costs ~4x a training step; cached batches are used once)")
    parser.add_argument("--autocast", default="auto", choices=["auto", "on", "off"],
                        help="bfloat16 autocast for training steps (auto: time a step both ways and keep the faster)")
    parser.add_argument("--train-sequences", type=int, default=0,
                        help="train on the first N training sequences only (0: all; the held-out set stays whole)")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop training after this many minutes (0: run to --steps)")
    parser.add_argument("--ckpt-minutes", type=float, default=5.0, help="checkpoint every this many minutes")
    parser.add_argument("--eval-minutes", type=float, default=15.0, help="speculative-decoding eval every this many minutes")
    parser.add_argument("--val-steps", type=int, default=250,
                        help="teacher-forced metrics on the held-out sequences every this many steps (0: off)")
    parser.add_argument("--eval-prompts", type=int, default=8, help="held-out validation prompts per eval")
    parser.add_argument("--eval-tokens", type=int, default=64, help="new tokens per eval prompt")
    parser.add_argument("--ship", default="", help="also export every best-tau checkpoint to this folder")
    parser.add_argument("--export-dir", default="",
                        help="stage export: the drafter folder to write (default OUT/latest)")
    parser.add_argument("--init", default="", help="initialise from this exported drafter when no ckpt.pt exists")


def _log(out: Path, name: str):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(out / f"{name}.log"), logging.StreamHandler(sys.stderr)], force=True)
    return logging.getLogger(f"bastion.train.{name}")


def stage_data(args, out: Path, log) -> None:
    """Append token shards to `--data-dir` until it holds `--response-tokens` (training.datagen)."""
    import torch

    from engine.forward import target_forward_for
    from engine.loader import cache_root, load_target
    from training.datagen import build_shards
    from training.train_loop import layer_ids_for

    measured, loaded = {}, {}
    if args.data_dtype == "auto":  # time the data stage's own workload in both dtypes, keep the faster
        from training.datagen import chat_ids
        from training.generate import throughput
        from training.prompts import training_prompts

        for name in ("float32", "bfloat16"):
            cand = loaded[name] = load_target(None, name)
            prompts = [chat_ids(cand.tokenizer, r["prompt"]) for r in training_prompts(32, seed=9)]
            # decode-heavy like a shard (responses of ~200 tokens after ~60-token prompts)
            measured[name] = round(throughput(target_forward_for(cand.model), prompts, 128, slots=32), 1)
        dtype = max(measured, key=measured.get)
    else:
        dtype = args.data_dtype
    target = loaded.get(dtype) or load_target(None, dtype)
    fw = target_forward_for(target.model)
    log.info("data: into %s until %d response tokens, %s (%s; generated tok/s measured %s), threads %d",
             args.data_dir, args.response_tokens, target.dtype, args.data_dtype, measured, torch.get_num_threads())
    man = build_shards(Path(args.data_dir), target, fw, args.response_tokens, shard_prompts=args.shard_prompts,
                       max_new=args.max_new, slots=args.gen_slots, max_shards=args.max_shards,
                       feature_cache=Path(args.feature_cache or cache_root() / "drafter-features"),
                       feature_layers=tuple(i + 1 for i in layer_ids_for(target.config, args.feature_layers)),
                       top_k=args.top_k,
                       progress=lambda e: log.info("%(file)s: %(sequences)d seqs, %(response_tokens)d response tokens, "
                                                   "%(seconds).0f s, %(response_tok_per_s).0f tok/s", e))
    log.info("data done: %s", man.get("totals"))


def train_dtype(args) -> str:
    """The train stage's target dtype: --data-dtype when given; for auto, the dtype most of the
    data's shards were generated in (their captured features are cached under it), else auto."""
    if args.data_dtype != "auto":
        return args.data_dtype
    from collections import Counter

    from training.shards import read_manifest

    dtypes = Counter(s.get("dtype") for s in read_manifest(Path(args.data_dir))["shards"] if s.get("dtype"))
    return dtypes.most_common(1)[0][0] if dtypes else "auto"


def run(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        print(f"unknown stage(s) {bad}; choose from {STAGES}", file=sys.stderr)
        return 2
    log = _log(out, "_".join(stages))
    t0 = time.time()
    if "data" in stages:
        stage_data(args, out, log)
    if "train" in stages:
        from training.train_loop import train_stage

        from engine.loader import load_target

        train_stage(args, out, log, target=load_target(None, train_dtype(args), auto_sizes=(1, 64)))
    if "export" in stages:
        from engine.loader import load_target
        from training.train_loop import export_latest

        dest = Path(args.export_dir or out / "latest")
        state = export_latest(out, Path(args.state_dir), load_target(None, "float32").model, dest)
        log.info("export: step %d (%.2f h trained) written to %s", state["step"], state["train_s"] / 3600, dest)
    log.info("done in %.0f s", time.time() - t0)
    return 0
