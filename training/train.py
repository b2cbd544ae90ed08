"""Training a DFlash drafter (the recipe of docs/method.md, section 2) on target-generated data, on CPU.

One optimisation step: a batch of sequences (token ids + the target's features at the
drafter's layers), `blocks` random anchors per sequence inside the response, all blocks
of a sequence in ONE drafter forward:

    queries  = blocks j = 0..nb-1, each [tok[a_j], MASK x (B-1)] at positions a_j .. a_j+B-1
    keys     = context features 0..T-1, then every block's entries
    mask     = block j sees context c < a_j and its own block (both directions), never
               another block (`block_attention_mask`)
    loss     = sum_k w_k CE(q_k, tok[a_j + k]) / sum w_k,  w_k = exp(-(k-1)/gamma), k = 1..B-1

plus, optionally, soft-label distillation from the target's stored top-k log-probs
(`soft_weight`), the anchor-feature injection (the context feature at a_j - 1 added to
every block input, matching `DFlashDrafter.propose`), and a reduced output vocabulary
(`d2t`: the most frequent response tokens, sharing the target's lm_head rows).
The target's embedding and lm_head are frozen and shared; only the drafter trains.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafting.dflash import DFlashDrafter, DFlashModel, make_spec_for_target

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class TrainConfig:
    """Drafter shape and optimisation settings (stored in every checkpoint)."""

    block_size: int = 8
    num_layers: int = 2
    intermediate_size: int | None = None  # None: the target's
    target_layer_ids: tuple[int, ...] = (1, 14, 27)
    mask_token_id: int = 16  # SmolLM2 '<empty_output>': a special token chat never uses
    inject_anchor: bool = True
    draft_vocab: int = 8192  # 0: the full target vocabulary
    gamma: float | None = None  # None: DEFAULT_GAMMA for the block size (else B/2)
    soft_weight: float = 0.5  # share of the soft-label (target top-k) loss
    blocks: int = 16  # anchors per sequence per step
    batch: int = 8  # sequences per step
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: float = 0.04
    steps: int = 20000  # cosine horizon
    min_lr_frac: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    autocast: bool = True  # bfloat16 autocast; the train stage measures which is faster (choose_autocast)

    def loss_gamma(self) -> float:
        return self.gamma or DEFAULT_GAMMA.get(self.block_size, self.block_size / 2)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["target_layer_ids"] = tuple(d.get("target_layer_ids", cls.target_layer_ids))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Boolean [b, 1, nb*B, ctx_len + nb*B] mask (True = visible) for blocks at `anchors` [b, nb].

    Query row j*B + i (block j) sees context keys c < anchors[j] and the keys of its own
    block j, and nothing else.
    """
    b, nb = anchors.shape
    B = block_size
    dev = anchors.device
    q_block = torch.arange(nb * B, device=dev) // B  # [Q]
    ctx_vis = torch.arange(ctx_len, device=dev)[None, None, :] < anchors.repeat_interleave(B, dim=1)[:, :, None]
    own = q_block[:, None] == q_block[None, :]  # [Q, Q]
    return torch.cat([ctx_vis, own[None].expand(b, -1, -1)], dim=2)[:, None]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup` of the horizon, then cosine decay to min_lr_frac * lr."""
    warm = max(1, int(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    p = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def token_counts(sequences, vocab_size: int, top_weight: int = 1, resp_weight: int = 8) -> torch.Tensor:
    """Response-token counts (x resp_weight) plus the target's top-k candidates (x top_weight) -> int64 [V].

    The top-k lists make the estimate far better than the responses alone on little data
    (held-out coverage of an 8k vocabulary from 64 responses: 79 % -> 93 %).
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        counts += resp_weight * torch.bincount(s["ids"][s["prompt_len"]:].long(), minlength=vocab_size)
        if top_weight and "top_ids" in s:
            counts += top_weight * torch.bincount(s["top_ids"].long().flatten(), minlength=vocab_size)
    return counts


def frequent_vocab(sequences, vocab_size: int, size: int, counts: torch.Tensor | None = None) -> torch.Tensor:
    """d2t: the `size` most frequent target ids (see `token_counts`), sorted -> int64 [size]."""
    if counts is None:
        counts = token_counts(sequences, vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)[:size]
    return torch.sort(order).values


class DrafterTrainer(nn.Module):
    """The trainable DFlashModel plus the target's frozen embedding and (reduced) lm_head rows.

    target_model: the target (only its input embedding and lm_head weights are used).
    d2t: reduced vocabulary (int64 [Vd]) or None for the full vocabulary.
    """

    def __init__(self, target_model: nn.Module, cfg: TrainConfig, d2t: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        tcfg = target_model.config
        spec = make_spec_for_target(
            tcfg, num_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
            target_layer_ids=list(cfg.target_layer_ids), intermediate_size=cfg.intermediate_size,
            inject_anchor=cfg.inject_anchor, draft_vocab_size=len(d2t) if d2t is not None else None,
        )
        g = torch.Generator().manual_seed(cfg.seed)
        self.model = DFlashModel(spec, target_hidden=tcfg.hidden_size)
        for p in self.model.parameters():
            if p.dim() == 2:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        emb = target_model.get_input_embeddings().weight.detach().float()
        self.register_buffer("embed_w", emb.clone(), persistent=False)
        self._full_head = target_model.get_output_embeddings().weight.detach()
        self.set_vocab(d2t)

    def set_vocab(self, d2t: torch.Tensor | None) -> None:
        """Select the output vocabulary (None: full). The drafter's weights do not depend on it,
        so it can be re-chosen at any time as more data arrives."""
        V = self._full_head.shape[0]
        if d2t is not None:
            self.model.d2t.copy_(d2t)
            t2d = torch.full((V,), -1, dtype=torch.long)
            t2d[d2t] = torch.arange(len(d2t))
            self.head_w = self._full_head[d2t].float()
        else:
            t2d = torch.arange(V)
            self.head_w = self._full_head.float()
        self.t2d = t2d

    @property
    def spec(self):
        return self.model.spec

    def forward(self, batch: dict) -> dict:
        """Loss and metrics for a batch from `make_batch` (see module doc): loss, hard (and soft),
        acc1 (position-1 top-1 accuracy), est_tau (1 + mean correct run of the in-sequence blocks),
        correct (bool [b, nb, B-1]: the drafted token at block position k matches the data)."""
        cfg = self.cfg
        m = self.model
        B = cfg.block_size
        feats, ids, anchors, avalid, lens = batch["features"], batch["ids"], batch["anchors"], batch["valid"], batch["lens"]
        b, T, _ = feats.shape
        nb = anchors.shape[1]
        dev = feats.device
        ctx = m.context_features(feats.to(m.fc.weight.dtype))  # [b, T, H]
        block_ids = torch.full((b, nb, B), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        x = F.embedding(block_ids, self.embed_w)  # [b, nb, B, H]
        if cfg.inject_anchor:
            prev = ctx.gather(1, (anchors - 1).clamp(min=0)[:, :, None].expand(-1, -1, ctx.shape[-1]))
            x = x + prev[:, :, None, :]
        pos = anchors[:, :, None] + torch.arange(B, device=dev)  # [b, nb, B]
        mask = block_attention_mask(anchors, T, B)
        ctx_pos = torch.arange(T, device=dev)[None].expand(b, -1)
        h, _ = m.forward_block(x.reshape(b, nb * B, -1), pos.reshape(b, nb * B), ctx, ctx_pos, None, mask)
        h = h.view(b, nb, B, -1)[:, :, 1:]  # [b, nb, B-1, H]
        logits = F.linear(h, self.head_w.to(h.dtype)).float()  # [b, nb, B-1, Vd]
        lp = torch.log_softmax(logits, dim=-1)
        tpos = pos[:, :, 1:]  # positions of the predicted tokens
        in_seq = (tpos < lens[:, None, None]) & avalid[:, :, None]
        labels_t = ids.gather(1, tpos.clamp(max=ids.shape[1] - 1).reshape(b, -1)).view_as(tpos)
        labels = self.t2d[labels_t]
        k = torch.arange(1, B, device=dev, dtype=torch.float32)
        w = torch.exp(-(k - 1) / cfg.loss_gamma())[None, None, :] * in_seq
        hard_ok = w * (labels >= 0)
        nll = -lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        hard = (nll * hard_ok).sum() / hard_ok.sum().clamp(min=1e-6)
        loss = hard
        out = {}
        if cfg.soft_weight > 0 and "top_ids" in batch:
            # Target top-k at the position before each predicted token, restricted to the draft vocabulary.
            tids = batch["top_ids"].gather(1, (tpos - 1).clamp(max=ids.shape[1] - 2).reshape(b, -1, 1)
                                           .expand(-1, -1, batch["top_ids"].shape[-1]))
            tlp = batch["top_lp"].gather(1, (tpos - 1).clamp(max=ids.shape[1] - 2).reshape(b, -1, 1)
                                         .expand(-1, -1, batch["top_lp"].shape[-1])).float()
            dids = self.t2d[tids.long()]
            tlp = tlp.masked_fill(dids < 0, float("-inf"))
            p = torch.softmax(tlp, dim=-1).nan_to_num(0.0).view(*tpos.shape, -1)
            qlp = lp.gather(-1, dids.clamp(min=0).view(*tpos.shape, -1))
            soft_tok = -(p * qlp).sum(-1)
            soft = (soft_tok * w).sum() / w.sum().clamp(min=1e-6)
            loss = (1 - cfg.soft_weight) * hard + cfg.soft_weight * soft
            out["soft"] = soft.detach()
        with torch.no_grad():
            pred = lp.argmax(-1)
            correct = (pred == labels) & (labels >= 0) & in_seq
            acc1 = correct[:, :, 0].sum() / in_seq[:, :, 0].sum().clamp(min=1)
            full = avalid & in_seq.all(-1)  # blocks whose every label is inside the sequence
            run = torch.cumprod(correct.float(), dim=-1).sum(-1)  # accepted chain length per block
            est_tau = 1 + (run * full).sum() / full.sum().clamp(min=1)
        out.update(loss=loss, hard=hard.detach(), acc1=acc1, est_tau=est_tau, correct=correct)
        return out


def make_batch(seqs: list[dict], cfg: TrainConfig, gen: torch.Generator, soft: bool = True,
               anchors: torch.Tensor | None = None) -> dict:
    """Pad `seqs` (right) and draw `cfg.blocks` anchors per sequence inside the response
    (or take `anchors`, int64 [len(seqs), nb], all valid, when given).

    Anchors a satisfy prompt_len <= a <= T-2 (at least one label); drawn without
    replacement where the response is long enough. Returns tensors for DrafterTrainer.
    """
    b = len(seqs)
    T = max(len(s["ids"]) for s in seqs)
    D = seqs[0]["features"].shape[-1]
    ids = torch.zeros((b, T), dtype=torch.long)
    feats = torch.zeros((b, T, D), dtype=torch.bfloat16)
    lens = torch.zeros(b, dtype=torch.long)
    given = anchors
    nb = cfg.blocks if given is None else given.shape[1]
    anchors = torch.ones((b, nb), dtype=torch.long) if given is None else given.clone()
    valid = torch.full((b, nb), given is not None, dtype=torch.bool)
    K = seqs[0]["top_ids"].shape[-1] if soft and "top_ids" in seqs[0] else 0
    if K:
        top_ids = torch.zeros((b, T, K), dtype=torch.int32)
        top_lp = torch.full((b, T, K), -1e4, dtype=torch.float16)
    for i, s in enumerate(seqs):
        n, pl = len(s["ids"]), int(s["prompt_len"])
        ids[i, :n] = s["ids"].long()
        feats[i, : n - 1] = s["features"]
        lens[i] = n
        if K:
            top_ids[i, pl - 1 : n - 1] = s["top_ids"][: n - pl]
            top_lp[i, pl - 1 : n - 1] = s["top_lp"][: n - pl]
        cand = n - 1 - pl  # anchors pl .. n-2
        if given is not None or cand <= 0:
            continue
        if cand >= nb:
            a = torch.randperm(cand, generator=gen)[:nb] + pl
        else:
            a = torch.randint(0, cand, (nb,), generator=gen) + pl
        anchors[i] = torch.sort(a).values
        valid[i] = True
    out = {"ids": ids, "features": feats, "lens": lens, "anchors": anchors, "valid": valid}
    if K:
        out["top_ids"], out["top_lp"] = top_ids, top_lp
    return out


def to_drafter(trainer: DrafterTrainer, target_model: nn.Module) -> DFlashDrafter:
    """An inference DFlashDrafter sharing the current weights (cast to the target's dtype)."""
    import copy

    model = copy.deepcopy(trainer.model)
    p = next(target_model.parameters())
    model.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)
    if model.d2t is not None:
        model.d2t = model.d2t.long()
    return DFlashDrafter(model, target_model.get_input_embeddings(), target_model.get_output_embeddings())
