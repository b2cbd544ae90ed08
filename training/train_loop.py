"""The train stage: token shards + cached features, AdamW + warm-up/cosine, resumable state, tau evaluation, export.

Data: `TokenData` reads the committed token shards (training.shards) and gets each
sequence's target features from a `training.features.FeatureStore` (teacher-forced on
first use, cached outside git). `EpochSampler` visits every sequence once per epoch in a
fresh seeded order; `make_batch` draws the anchors of each visit anew.

State, two copies:
    out/train/ckpt.pt      exact (float32 everything), written every --ckpt-minutes: resume on this machine
    --state-dir            compact, meant for git (data/drafter-train by default): state.safetensors
                           (float32 weights, AdamW moments in bfloat16 while they fit STATE_MOMENTS_LIMIT,
                           the anchor generator's state),
                           state.json (config, counters, sampler cursor), loss.jsonl and eval.jsonl
                           (the learning curve); written with every ckpt.pt
On start the newer of the two is resumed (by step), else `--init` (an exported drafter),
else a fresh initialisation.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from drafting.dflash import save_dflash
from training.features import FeatureStore, store_key, teacher_forced
from training.shards import read_manifest, read_shard
from training.train import DrafterTrainer, TrainConfig, frequent_vocab, lr_at, make_batch, to_drafter


#: One sequence in this many of every shard is held out of training for `validate`.
HOLDOUT_EVERY = 64


class TokenData:
    """The token shards of a data folder with their features, computed on first use.

    fw: the target's engine.forward.TargetForward (features come from it, teacher-forced);
    layers: feature layers (HF hidden_states indices); cache_dir: where FeatureStores live.
    Sequences with fewer than `min_response` response tokens are skipped. Every
    `HOLDOUT_EVERY`-th sequence of each shard (j % holdout_every == holdout_every - 1; 0: none) is held
    out: `train_idx` lists the sequences training samples, `val_idx` the held-out ones that
    `validate` scores (the same sequences on every machine, since shards are in git). max_train > 0
    keeps only the first max_train training sequences in manifest order (a data-subset ablation:
    the held-out set stays whole, so every run is scored on the same sequences; the cap holds
    across `refresh` calls). `tokens` counts the response tokens of the sequences used (training
    and held-out). Raises ValueError for a negative max_train.
    """

    def __init__(self, folder: Path, fw, layers: tuple[int, ...], cache_dir: Path, top_k: int = 8,
                 min_response: int = 2, holdout_every: int | None = None, max_train: int = 0):
        self.holdout_every = HOLDOUT_EVERY if holdout_every is None else holdout_every
        if max_train < 0:
            raise ValueError(f"max_train is a count of sequences (0: all), got {max_train}")
        self.max_train = max_train
        self.folder, self.fw, self.layers, self.top_k = Path(folder), fw, tuple(layers), top_k
        self.cache_dir = Path(cache_dir)
        self.min_response = min_response
        self.loaded: list[str] = []
        self.ids: list[torch.Tensor] = []
        self.prompt_lens: list[int] = []
        self._where: list[tuple[FeatureStore, int]] = []
        self.tokens = 0  # response tokens of the training and held-out sequences
        self.train_idx: list[int] = []
        self.val_idx: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def refresh(self) -> int:
        """Load shards of the manifest not loaded yet (checksums verified); returns how many."""
        man = read_manifest(self.folder)
        width = len(self.layers) * int(self.fw.config.hidden_size)
        new = 0
        for entry in man["shards"]:
            if entry["file"] in self.loaded:
                continue
            seqs = read_shard(self.folder, entry, man["sources"])
            store = FeatureStore(self.cache_dir,
                                 store_key(entry["sha256"], self.layers, self.top_k, self.fw.dtype, width),
                                 [len(s.ids) for s in seqs], [s.prompt_len for s in seqs], width, self.top_k)
            for j, s in enumerate(seqs):
                if s.response_len < self.min_response:
                    continue
                self.ids.append(torch.from_numpy(s.ids).int())
                self.prompt_lens.append(s.prompt_len)
                self._where.append((store, j))
                held = self.holdout_every and j % self.holdout_every == self.holdout_every - 1
                if held:
                    self.val_idx.append(len(self.ids) - 1)
                elif not self.max_train or len(self.train_idx) < self.max_train:
                    self.train_idx.append(len(self.ids) - 1)
                else:
                    continue
                self.tokens += s.response_len
            self.loaded.append(entry["file"])
            new += 1
        return new

    def counts(self, vocab_size: int) -> torch.Tensor:
        """Response-token counts over the training sequences (held-out ones excluded) -> int64 [vocab_size]."""
        c = torch.zeros(vocab_size, dtype=torch.long)
        for i in self.train_idx:
            c += torch.bincount(self.ids[i][self.prompt_lens[i]:].long(), minlength=vocab_size)
        return c

    def uncached(self, indices: list[int]) -> list[int]:
        """Those of sequences `indices` with no cached features yet (`records` runs the target for them)."""
        return [i for i in indices if not self._where[i][0].done[self._where[i][1]]]

    def records(self, indices: list[int]) -> list[dict]:
        """Training records (ids, prompt_len, features, top_ids, top_lp) of sequences `indices`,
        computing the missing features in one teacher-forced call first."""
        todo = self.uncached(indices)
        if todo:
            for i, rec in zip(todo, teacher_forced(self.fw, [(self.ids[i].numpy(), self.prompt_lens[i]) for i in todo],
                                                   self.layers, self.top_k)):
                store, j = self._where[i]
                store.put(j, rec)
        out = []
        for i in indices:
            store, j = self._where[i]
            out.append({"ids": self.ids[i], "prompt_len": self.prompt_lens[i], **store.get(j)})
        return out


class EpochSampler:
    """Sequence indices in a fresh seeded random order each epoch; the cursor is its whole state.

    Sequences added while an epoch runs join at the next epoch.
    """

    def __init__(self, seed: int, epoch: int = 0, pos: int = 0, n: int = 0):
        self.seed, self.epoch, self.pos, self.n = seed, epoch, pos, n

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))

    def take(self, total: int, k: int) -> list[int]:
        """The next `k` indices (of `total` sequences now loaded), crossing into the next epoch as needed.

        An epoch begun over more sequences than are loaded now (a resume over less data) is
        ended and a new one begun. Raises ValueError when total < 1.
        """
        if total < 1:
            raise ValueError("no sequences to sample")
        out: list[int] = []
        while len(out) < k:
            if self.n == 0 or self.pos >= self.n or self.n > total:
                if self.n:
                    self.epoch += 1
                self.n, self.pos = total, 0
            order = self._order()
            take = order[self.pos:self.pos + k - len(out)].tolist()
            out += take
            self.pos += len(take)
        return out

    def state_dict(self) -> dict:
        """The cursor: seed, epoch, position in the epoch, sequences the epoch was drawn over."""
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos, "n": self.n}

    @classmethod
    def from_state(cls, d: dict) -> "EpochSampler":
        """The sampler a `state_dict` describes."""
        return cls(d["seed"], d["epoch"], d["pos"], d["n"])


#: Seed of the held-out Magpie prompts (the data stage seeds shard k with k).
VALIDATION_MAGPIE_SEED = 10**6


def validation_prompts(n: int, train_texts, seed: int = 777, target=None) -> list[str]:
    """`n` held-out prompts, none whose normalised words (training.datagen.prompt_key) equal a
    training prompt's: with a target, half are Magpie user turns it writes under a seed no
    shard uses and half come from another seed of training_prompts; without, all of the latter."""
    from training.datagen import magpie_prompts, prompt_key
    from training.prompts import OVERLAP_SPAN, _span_index, default_benchmark_texts, training_prompts

    seen = {prompt_key(t) for t in train_texts}
    magpie = []
    if target is not None and n >= 2:
        from engine.forward import target_forward_for

        magpie = magpie_prompts(target_forward_for(target.model), target.tokenizer, target.eos_token_ids, n // 2,
                                VALIDATION_MAGPIE_SEED, set(seen), _span_index(default_benchmark_texts(), OVERLAP_SPAN),
                                slots=16)
    rows = training_prompts(max(4 * n, 60), seed=seed)
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = [r["prompt"] for r in rows if prompt_key(r["prompt"]) not in seen]
    return out[:n - len(magpie)] + magpie


@torch.no_grad()
def evaluate_tau(target, drafter, prompts: list[str], max_tokens: int, modes=(("chain", 0), ("tree", 32))) -> dict:
    """Greedy speculative decoding through engine.Engine with `drafter` (a DFlashDrafter: the
    trainer's current weights via `to_drafter`, or a loaded export); mean tau per mode, all
    steps pooled, and seconds per mode."""
    from engine.engine import Engine, make_controller
    from engine.sampling import SamplingParams

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


@torch.no_grad()
def validate(trainer: DrafterTrainer, data: TokenData, seed: int = 1, batch: int = 8, walk: bool = False) -> dict:
    """Teacher-forced metrics on the held-out sequences (`data.val_idx`), eval mode, fixed anchors.

    Returns {"val_loss", "val_acc1", "val_tau_est"}: means over batches of DrafterTrainer's loss,
    position-1 top-1 accuracy and chain-tau estimate (1 + expected accepted run of a block at a
    random anchor; an upper bound of engine tau, whose anchors follow rejections). With `walk`,
    also "val_tau_walk" and "val_tau_walk64": `walk_tau` over whole responses and over their
    first 64 tokens. Empty when no sequence is held out.
    """
    if not data.val_idx:
        return {}
    cfg = trainer.cfg
    gen = torch.Generator().manual_seed(seed)
    was_training = trainer.model.training
    trainer.model.eval()
    sums = {"val_loss": 0.0, "val_acc1": 0.0, "val_tau_est": 0.0}
    n = 0
    for i in range(0, len(data.val_idx), batch):
        b = make_batch(data.records(data.val_idx[i:i + batch]), cfg, gen, soft=cfg.soft_weight > 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            out = trainer(b)
        sums["val_loss"] += float(out["loss"])
        sums["val_acc1"] += float(out["acc1"])
        sums["val_tau_est"] += float(out["est_tau"])
        n += 1
    res = {k: round(v / n, 5) for k, v in sums.items()}
    if walk:
        recs = data.records(data.val_idx)
        res["val_tau_walk"], res["val_tau_walk64"] = (round(t, 5) for t in walk_tau(trainer, recs, (None, 64)))
    trainer.model.train(was_training)
    return res


@torch.no_grad()
def walk_tau(trainer: DrafterTrainer, records: list[dict], horizons: tuple[int | None, ...] = (None,)) -> list[float]:
    """The chain tau greedy speculative decoding with the trainer's drafter reaches on `records`,
    computed teacher-forced, for each horizon (new tokens decoded; None: the whole response).

    Each record is the target's greedy answer to its prompt, so speculative decoding of that
    prompt emits exactly these tokens: the block anchored at position a (the token the last
    verification emitted) keeps its leading run r of correct drafts, the target adds the bonus
    token, and the next block is anchored at a + r + 1; the first anchor is the first response
    token (it comes from the prefill). One drafter forward per record drafts the blocks of every
    anchor at once (`DrafterTrainer.forward`, which a test shows equal to inference), then the walk
    replays acceptance. Returns, per horizon, accepted tokens per step (bonus included) over all
    records: the engine's chain tau (docs/method.md).
    """
    per = [[] for _ in horizons]
    for rec in records:
        runs = _anchor_runs(trainer, rec)
        for out, h in zip(per, horizons):
            out += _replay(runs, int(rec["prompt_len"]), len(rec["ids"]), h)
    return [sum(p) / max(1, len(p)) for p in per]


def walk_steps(trainer: DrafterTrainer, rec: dict, max_new: int | None = None) -> list[int]:
    """Tokens accepted at each step (bonus included) of `walk_tau`'s replay of one record."""
    return _replay(_anchor_runs(trainer, rec), int(rec["prompt_len"]), len(rec["ids"]), max_new)


def _replay(runs: list[int], pl: int, n: int, max_new: int | None) -> list[int]:
    """Accepted tokens per step when decoding positions pl .. limit-1, given each anchor's run of
    correct drafts (`runs[a - pl]`, counted inside the whole record)."""
    limit = n if max_new is None else min(n, pl + max_new)
    out, a = [], pl
    while a < limit - 1:
        out.append(min(runs[a - pl], limit - 1 - a) + 1)
        a += out[-1]
    return out


@torch.no_grad()
def _anchor_runs(trainer: DrafterTrainer, rec: dict) -> list[int]:
    """For every anchor a = prompt_len .. n-2 of a record, the leading run of correct drafts of its block."""
    ids, pl = rec["ids"].long(), int(rec["prompt_len"])
    n = len(ids)
    if n - 1 <= pl:
        return []
    b = make_batch([rec], trainer.cfg, None, soft=False, anchors=torch.arange(pl, n - 1)[None])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=trainer.cfg.autocast):
        correct = trainer(b)["correct"][0]  # [anchors, B-1], False past the record
    return torch.cumprod(correct.int(), dim=-1).sum(-1).tolist()


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
    """The exact resume point (float32 weights and moments, counters, sampler and generator state)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": trainer.model.state_dict(), "opt": opt.state_dict(), "cfg": trainer.cfg.to_dict(),
                "state": state}, tmp)
    tmp.rename(path)


#: The committed state keeps the AdamW moments only while it stays under this size (bytes): a
#: 2-layer drafter's float32 weights are 32 MB and its bfloat16 moments another 32 MB.
STATE_MOMENTS_LIMIT = 50_000_000


def save_state(folder: Path, trainer: DrafterTrainer, opt, state: dict,
               moments_limit: int = STATE_MOMENTS_LIMIT) -> None:
    """The compact resume point for git: float32 weights, AdamW moments in bfloat16, counters.

    Writes folder/state.safetensors and folder/state.json (each atomically, json last; both
    carry the step, and `load_state` refuses a pair that disagrees). `state`
    holds the counters, the sampler cursor and the anchor generator's state (a uint8 tensor
    under "gen_state", stored in the safetensors file). When weights plus moments would exceed
    `moments_limit` bytes the moments are left out: a resume then starts them from zero, and
    AdamW's bias correction re-estimates them within a few tens of steps (betas 0.9 / 0.95).
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in trainer.model.state_dict().items()}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    moment_bytes = sum(2 * 2 * p.numel() for g in opt.param_groups for p in g["params"] if opt.state.get(p))
    steps = {}
    if weight_bytes + moment_bytes <= moments_limit:
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p)
                if st:
                    tensors[f"opt.{names[id(p)]}.exp_avg"] = st["exp_avg"].to(torch.bfloat16).contiguous()
                    tensors[f"opt.{names[id(p)]}.exp_avg_sq"] = st["exp_avg_sq"].to(torch.bfloat16).contiguous()
                    steps[names[id(p)]] = float(st["step"])
    meta = {k: v for k, v in state.items() if k != "gen_state"}
    if "gen_state" in state:
        tensors["gen_state"] = state["gen_state"]
    tmp = folder / "state.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "bastion-drafter-train-1", "step": str(state["step"])})
    tmp.rename(folder / "state.safetensors")
    body = {"cfg": trainer.cfg.to_dict(), "state": meta, "opt_steps": steps}
    (folder / "state.json.tmp").write_text(json.dumps(body, indent=1) + "\n")
    (folder / "state.json.tmp").rename(folder / "state.json")


def load_state(folder: Path) -> dict | None:
    """A checkpoint dict (model, opt, cfg, state; the shape `build` takes) from `save_state`'s
    files, or None when the folder has none. Raises ValueError when the two files are from
    different steps."""
    from safetensors.torch import load_file

    if not (folder / "state.json").exists():
        return None
    from safetensors import safe_open

    body = json.loads((folder / "state.json").read_text())
    with safe_open(str(folder / "state.safetensors"), framework="pt") as fh:
        step = (fh.metadata() or {}).get("step")
    if step != str(body["state"]["step"]):
        raise ValueError(f"{folder}: state.safetensors is from step {step}, state.json from step "
                         f"{body['state']['step']} (a write was interrupted); resume from ckpt.pt or an export")
    t = load_file(str(folder / "state.safetensors"))
    state = dict(body["state"])
    if "gen_state" in t:
        state["gen_state"] = t["gen_state"]
    model = {k[len("model."):]: v for k, v in t.items() if k.startswith("model.")}
    moments = {k[len("opt."):]: v.float() for k, v in t.items() if k.startswith("opt.")}
    return {"model": model, "cfg": body["cfg"], "state": state,
            "opt_named": {n: {"step": torch.tensor(s), "exp_avg": moments[f"{n}.exp_avg"],
                              "exp_avg_sq": moments[f"{n}.exp_avg_sq"]} for n, s in body["opt_steps"].items()}}


def build(target_model, cfg: TrainConfig, vocab_counts: torch.Tensor | None, ckpt: dict | None):
    """Trainer + optimiser, restored from `ckpt` when given (its d2t and config win).

    vocab_counts: token counts choosing the reduced vocabulary of a fresh run (`frequent_vocab`).
    ckpt: from torch.load(ckpt.pt) (key "opt": an optimiser state_dict) or `load_state`
    (key "opt_named": moments by parameter name).
    """
    d2t = None
    if ckpt is not None:
        cfg = TrainConfig.from_dict(ckpt["cfg"])
        if "d2t" in ckpt["model"]:
            d2t = ckpt["model"]["d2t"]
    elif cfg.draft_vocab:
        d2t = frequent_vocab([], target_model.config.vocab_size, cfg.draft_vocab, vocab_counts)
    trainer = DrafterTrainer(target_model, cfg, d2t)
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if ckpt is not None:
        trainer.model.load_state_dict(ckpt["model"])
        if "opt" in ckpt:
            opt.load_state_dict(ckpt["opt"])
        else:
            sd = opt.state_dict()
            sd["state"] = {i: ckpt["opt_named"][n] for i, (n, _) in enumerate(named) if n in ckpt["opt_named"]}
            opt.load_state_dict(sd)
    return trainer, opt


def train_step(trainer: DrafterTrainer, opt, batch: dict, step: int) -> dict:
    """One AdamW step (under bfloat16 autocast when cfg.autocast) with gradient clipping; returns float metrics."""
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
    m = {k: float(v.detach()) for k, v in out.items() if k != "correct"}
    m["grad_norm"] = float(gn)
    m["lr"] = opt.param_groups[0]["lr"]
    return m


def time_step(trainer: DrafterTrainer, batch: dict, autocast: bool, reps: int = 2, warm: bool = True) -> float:
    """Fastest of `reps` timings (seconds) of a training step's forward and backward (no
    optimiser step; gradients are dropped; the model is left in train mode, as train_step
    leaves it), with or without bfloat16 autocast, after one untimed warm-up when `warm`."""
    trainer.model.train()
    times = []
    for i in range(reps + int(warm)):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = trainer(batch)
        out["loss"].backward()
        if i or not warm:
            times.append(time.perf_counter() - t0)
        trainer.model.zero_grad(set_to_none=True)
    return min(times)


#: The mode a run already uses is kept unless the other is faster by more than this fraction
#: (near-ties would otherwise flip the numerics between sessions).
AUTOCAST_MARGIN = 0.15


def choose_autocast(trainer: DrafterTrainer, batch: dict, mode: str = "auto",
                    current: bool | None = None) -> tuple[bool, dict]:
    """Whether to train under bfloat16 autocast: "on" / "off" as given; "auto" times a step both
    ways on `batch` (time_step) and keeps the faster, or `current` (the resumed run's choice)
    unless the other is more than AUTOCAST_MARGIN faster. float32 is timed first; a cold
    bfloat16 step slower than twice that ends the probe (on an avx2-only EPYC a step took 23.1 s
    in bfloat16 against 1.45 s in float32; with avx512_bf16 bfloat16 was 1.6x faster,
    docs/drafter.md "Training on an avx2-only machine"). Returns (autocast, {"fp32_s",
    "bf16_s"} as timed). Raises ValueError for another mode."""
    if mode in ("on", "off"):
        return mode == "on", {}
    if mode != "auto":
        raise ValueError(f"autocast is auto, on or off, got {mode!r}")
    timed = {"fp32_s": time_step(trainer, batch, False)}
    timed["bf16_s"] = time_step(trainer, batch, True, reps=1, warm=False)
    if timed["bf16_s"] > 2 * timed["fp32_s"]:
        return False, timed
    timed["bf16_s"] = min(timed["bf16_s"], time_step(trainer, batch, True))
    faster = timed["bf16_s"] < timed["fp32_s"]
    if current is not None and faster != current:
        t_cur, t_other = (timed["bf16_s"], timed["fp32_s"]) if current else (timed["fp32_s"], timed["bf16_s"])
        if t_other > (1 - AUTOCAST_MARGIN) * t_cur:
            return current, timed
    return faster, timed


def config_from_args(args, target_config) -> TrainConfig:
    """The TrainConfig of the command line's training flags for this target; its target layers are
    `--feature-layers` (default 3) spread by `layer_ids_for`. Raises ValueError as that does."""
    return TrainConfig(block_size=args.block_size, num_layers=args.layers, draft_vocab=args.draft_vocab,
                       inject_anchor=not args.no_inject, soft_weight=args.soft_weight, lr=args.lr, steps=args.steps,
                       batch=args.batch, blocks=args.blocks,
                       target_layer_ids=tuple(layer_ids_for(target_config, getattr(args, "feature_layers", 3))))


def layer_ids_for(target_config, count: int = 3) -> list[int]:
    """The drafter's `count` target layers: TrainConfig's default (three) where the target has them,
    else `count` spread evenly by the default rule (docs/method.md section 2; for SmolLM2's 30
    layers five are [1, 8, 14, 20, 27], a superset of the default three). Raises ValueError for
    count < 1 or a count the rule spreads with repeats (28 of 30 layers: two 14s)."""
    n = int(target_config.num_hidden_layers)
    ids = list(TrainConfig.target_layer_ids)
    if count != len(ids) or max(ids) >= n:
        from drafting.dflash import default_target_layer_ids

        ids = default_target_layer_ids(n, max(count, 1))
    if len(set(ids)) != count:  # also count < 1: the rule gives at least one layer
        raise ValueError(f"{count} feature layers cannot be spread over this target's {n} layers "
                         f"without repeats (got {ids})")
    return ids


def _truncate_log(path: Path, step: int) -> None:
    """Drop the lines of a jsonl log whose step lies beyond `step`."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(keep) != len(lines):
        path.write_text("".join(line + "\n" for line in keep))


def _resume_point(tdir: Path, state_dir: Path) -> dict | None:
    """The newer (by step) of the exact local checkpoint and the committed compact state; the
    committed one when their drafter configs differ (the local file is then another run's)."""
    local = torch.load(tdir / "ckpt.pt", weights_only=False) if (tdir / "ckpt.pt").exists() else None
    committed = load_state(state_dir)
    def shape(ck: dict) -> dict:  # the run's recipe; the horizon may grow, autocast is the machine's
        return {k: v for k, v in ck["cfg"].items() if k not in ("steps", "autocast")}

    if committed is not None and local is not None and shape(local) != shape(committed):
        return committed
    if local is None or (committed is not None and committed["state"]["step"] > local["state"]["step"]):
        return committed
    return local


def export_latest(out: Path, state_dir: Path, target_model, path: Path) -> dict:
    """Export the newest training state (out/train/ckpt.pt or the committed `state_dir`, as a
    resume would pick) as a drafter folder at `path`; returns that state's counters.

    The weights are written in bfloat16 like every shipped export (`export`). Raises
    SystemExit when neither state exists.
    """
    ckpt = _resume_point(out / "train", state_dir)
    if ckpt is None:
        raise SystemExit(f"no training state in {out / 'train'} or {state_dir}: train first")
    trainer, _ = build(target_model, TrainConfig.from_dict(ckpt["cfg"]), None, ckpt)
    export(trainer, path)
    return {k: v for k, v in ckpt["state"].items() if not isinstance(v, (torch.Tensor, dict, list))}


def train_stage(args, out: Path, log, target=None) -> None:
    """Train until `args.steps` (the cosine horizon; may be raised on resume) or `args.minutes`.

    target: a loaded engine.loader.Target (default: the embedded target in float32); features
    and evaluation both run through it, in its dtype. args.echo (default 1): a batch that ran the
    target for its features is trained on that many consecutive steps, anchors re-drawn each time
    (data echoing, Choi et al. 2019, arXiv 1907.05550; docs/drafter.md); the repeat and its
    sequences are part of the resumable state.
    """
    from engine.forward import target_forward_for
    from engine.loader import cache_root, load_target

    tdir = out / "train"
    tdir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if target is None:
        target = load_target(None, "float32")
    fw = target_forward_for(target.model)
    cfg = config_from_args(args, target.config)
    ckpt = _resume_point(tdir, state_dir)
    subset = int(getattr(args, "train_sequences", 0))
    if ckpt is not None:
        resumed, its_subset = TrainConfig.from_dict(ckpt["cfg"]), ckpt["state"].get("train_sequences", 0)
        if cfg.target_layer_ids != resumed.target_layer_ids:
            log.warning("train: the run resumed reads target layers %s; --feature-layers applies to new runs only "
                        "(give those their own --state-dir and --out)", list(resumed.target_layer_ids))
        if its_subset != subset:
            raise SystemExit(f"the run in {state_dir} trained on --train-sequences {its_subset} (0: all), not "
                             f"{subset}: pass that, or give another run its own --state-dir and --out")
        cfg = resumed
    layers = tuple(i + 1 for i in cfg.target_layer_ids)
    data = TokenData(Path(args.data_dir), fw, layers, Path(args.feature_cache or cache_root() / "drafter-features"),
                     top_k=args.top_k, max_train=subset)
    data.refresh()
    if not data.train_idx:
        raise SystemExit(f"no training sequences in {args.data_dir}: run the data stage first")
    log.info("train: %d training sequences (%d held out), %d response tokens", len(data.train_idx),
             len(data.val_idx), data.tokens)
    V = target.config.vocab_size
    trainer, opt = build(target.model, cfg, data.counts(V), ckpt)
    cfg = trainer.cfg
    if cfg.draft_vocab:  # re-chosen from all data loaded now (the weights do not depend on it)
        trainer.set_vocab(frequent_vocab([], V, cfg.draft_vocab, data.counts(V)))
    cfg.steps = args.steps  # the horizon may grow when training continues
    state = dict(ckpt["state"]) if ckpt else {"step": 0, "train_s": 0.0, "blocks": 0, "best_tau": 0.0, "evals": 0,
                                              "feature_s": 0.0, "train_sequences": subset}
    if state["step"] < cfg.steps:  # the machine decides, on the first training sequences (their features are kept)
        t0 = time.perf_counter()
        probe = data.records(data.train_idx[: cfg.batch])
        state["feature_s"] = state.get("feature_s", 0.0) + time.perf_counter() - t0
        cfg.autocast, timed = choose_autocast(trainer, make_batch(probe, cfg, torch.Generator().manual_seed(0),
                                                                  soft=cfg.soft_weight > 0),
                                              args.autocast, current=cfg.autocast if ckpt else None)
        log.info("train: bfloat16 autocast %s (%s)", "on" if cfg.autocast else "off",
                 ", ".join(f"{k} {v:.2f}" for k, v in timed.items()) or "as asked")
    if ckpt is None and args.init:
        from drafting.dflash import load_dflash

        init = load_dflash(args.init, target.model).model
        trainer.model.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
        log.info("train: initialised from %s", args.init)
    for name in ("loss.jsonl", "eval.jsonl"):  # lines written after the checkpoint resumed from are redone
        _truncate_log(state_dir / name, state["step"])
    log.info("train: %s from step %d (%.1f min trained), cfg %s", "resumed" if ckpt else "started", state["step"],
             state["train_s"] / 60, cfg.to_dict())
    val = []
    if args.eval_prompts:
        from training.datagen import folder_prompt_texts

        val = validation_prompts(args.eval_prompts, folder_prompt_texts(Path(args.data_dir), target.tokenizer),
                                 target=target)
        log.info("train: %d held-out prompts: %s", len(val), [v[:60] for v in val])
    sampler = EpochSampler.from_state(state["sampler"]) if "sampler" in state else EpochSampler(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + state["step"])
    if "gen_state" in state:
        gen.set_state(state["gen_state"])
    echo = max(1, int(getattr(args, "echo", 1)))
    t_start = time.time()
    last_ckpt = last_eval = time.time()

    def run_eval():
        """Held-out tau of the current weights, logged; exported (and shipped) when it is the best."""
        ev = evaluate_tau(target, to_drafter(trainer, target.model), val, args.eval_tokens)
        ev.update(validate(trainer, data, walk=True))
        ev.update(step=state["step"], train_h=round(state["train_s"] / 3600, 4), blocks=state["blocks"],
                  data_tokens=data.tokens, epoch=sampler.epoch, time=time.time())
        with open(state_dir / "eval.jsonl", "a") as fh:
            fh.write(json.dumps(ev) + "\n")
        log.info("eval step %d: chain tau %.3f, tree32 tau %.3f", state["step"], ev["chain"], ev["tree32"])
        state["evals"] = state.get("evals", 0) + 1
        state["last_eval_step"] = state["step"]
        if ev["tree32"] > state["best_tau"]:
            state["best_tau"] = ev["tree32"]
            export(trainer, tdir / "best")
            (tdir / "best" / "eval.json").write_text(json.dumps(ev))
            if args.ship:
                export(trainer, Path(args.ship))
            log.info("eval: new best, exported")

    def checkpoint():
        state["sampler"] = sampler.state_dict()
        state["gen_state"] = gen.get_state()
        save_ckpt(tdir / "ckpt.pt", trainer, opt, state)
        save_state(state_dir, trainer, opt, state)

    agg, n_agg, t_log = {}, 0, time.perf_counter()
    while state["step"] < cfg.steps:
        if args.minutes and time.time() - t_start > args.minutes * 60:
            break
        if val and not state.get("baseline_done") and args.ship and (Path(args.ship) / "config.json").exists():
            # The ship rule compares with what is shipped, measured on the same prompts.
            from drafting.dflash import load_dflash

            ev = evaluate_tau(target, load_dflash(args.ship, target.model), val, args.eval_tokens)
            ev.update(baseline=str(args.ship), step=state["step"], time=time.time())
            with open(state_dir / "eval.jsonl", "a") as fh:
                fh.write(json.dumps(ev) + "\n")
            state["best_tau"] = ev["tree32"]
            state["baseline_done"] = True
            log.info("eval of the shipped drafter: chain tau %.3f, tree32 tau %.3f", ev["chain"], ev["tree32"])
        if val and time.time() - last_eval > args.eval_minutes * 60:
            run_eval()
            last_eval = time.time()
        if state["step"] % 200 == 0 and data.refresh():
            if cfg.draft_vocab:
                trainer.set_vocab(frequent_vocab([], V, cfg.draft_vocab, data.counts(V)))
            log.info("train: data now %d training sequences, %d response tokens", len(data.train_idx), data.tokens)
        t0 = time.perf_counter()
        if state.get("echo_left", 0) > 0:  # the sequences of the last computed batch again, new anchors
            idx = state["echo_idx"]
            state["echo_left"] -= 1
            state["echoed"] = state.get("echoed", 0) + 1
        else:
            idx = [data.train_idx[i] for i in sampler.take(len(data.train_idx), cfg.batch)]
            if echo > 1 and data.uncached(idx):
                state["echo_idx"], state["echo_left"] = idx, echo - 1
        seqs = data.records(idx)
        t1 = time.perf_counter()
        batch = make_batch(seqs, cfg, gen, soft=cfg.soft_weight > 0)
        m = train_step(trainer, opt, batch, state["step"])
        t2 = time.perf_counter()
        state["feature_s"] = state.get("feature_s", 0.0) + (t1 - t0)
        state["train_s"] += t2 - t1
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
                        epoch=sampler.epoch, feature_h=round(state["feature_s"] / 3600, 4), time=time.time())
            if args.val_steps and state["step"] - state.get("last_val_step", 0) >= args.val_steps:
                line.update(validate(trainer, data))
                state["last_val_step"] = state["step"]
            with open(state_dir / "loss.jsonl", "a") as fh:
                fh.write(json.dumps(line) + "\n")
            log.info("step %d loss %.3f acc1 %.3f est_tau %.3f lr %.2e %.0f blocks/s", state["step"], line["loss"],
                     line["acc1"], line["est_tau"], line["lr"], line["blocks_per_s"])
            agg, n_agg, t_log = {}, 0, time.perf_counter()
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            checkpoint()
            last_ckpt = time.time()
    if val and state.get("last_eval_step") != state["step"]:
        run_eval()  # where the run stops
    checkpoint()
    log.info("train: stopped at step %d (%.1f min trained)", state["step"], state["train_s"] / 60)
