"""The target's features for training, computed from token shards on first use and cached outside git.

Training needs, for every sequence of the token shards (training.shards), what the target
computes when it reads the sequence teacher-forced:

    features  bfloat16 [T - 1, n_layers * H]   hidden states at the drafter's feature layers
                                               for positions 0 .. T-2 (HF hidden_states indices)
    top_ids   int32    [T - prompt_len, k]     the target's top-k next tokens at positions
    top_lp    float16  [T - prompt_len, k]     prompt_len - 1 .. T-2, and their log-probs

`teacher_forced` computes them with the engine's target forward (several sequences per
forward, logits only at response positions). `FeatureStore` keeps them for one shard in
memory-mapped files under the cache directory, keyed by the shard's sha256, the feature
layers, k and the dtype; a sequence is computed the first time a batch asks for it and
read back from the files afterwards, so the first epoch runs the target once per
sequence and later epochs (and later processes) only read. Measured costs are in
docs/drafter.md.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from engine.forward import Segment, TargetForward


@torch.inference_mode()
def teacher_forced(fw: TargetForward, seqs: list[tuple[np.ndarray, int]], layers: tuple[int, ...], top_k: int,
                   max_rows: int = 1024) -> list[dict]:
    """Features and top-k of each (ids [T] int, prompt_len) sequence; see the module docstring.

    Sequences are packed into forwards of at most `max_rows` tokens (a longer one goes
    alone; 1,024 measured fastest here: 826 tokens/s against 714 at 2,048, docs/drafter.md). Returns one dict per sequence with features, top_ids, top_lp (CPU tensors).
    Raises ValueError for a sequence without a response token.
    """
    out: list[dict | None] = [None] * len(seqs)
    for i, (ids, pl) in enumerate(seqs):
        if not 0 < pl < len(ids):
            raise ValueError(f"sequence {i}: prompt_len {pl} leaves no response in {len(ids)} tokens")
    start = 0
    while start < len(seqs):
        group = [start]
        rows = len(seqs[start][0])
        while group[-1] + 1 < len(seqs) and rows + len(seqs[group[-1] + 1][0]) <= max_rows:
            group.append(group[-1] + 1)
            rows += len(seqs[group[-1]][0])
        start = group[-1] + 1
        pool = fw.new_pool(len(group), max(len(seqs[i][0]) for i in group))
        dev = fw.device
        toks = torch.cat([torch.as_tensor(seqs[i][0], dtype=torch.long) for i in group]).to(dev)
        pos = torch.cat([torch.arange(len(seqs[i][0]), device=dev) for i in group])
        segs, want, row = [], [], 0
        for j, i in enumerate(group):
            n, pl = len(seqs[i][0]), seqs[i][1]
            segs.append(Segment(j, 0, n))
            want.append(torch.arange(row + pl - 1, row + n - 1, device=dev))
            row += n
        logits, feats = fw(pool, toks, pos, segs, feature_layers=layers, logit_rows=torch.cat(want))
        top = torch.topk(torch.log_softmax(logits.float(), dim=-1), top_k, dim=-1)
        row = trow = 0
        for i in group:
            n, pl = len(seqs[i][0]), seqs[i][1]
            m = n - pl
            out[i] = {"features": feats[row:row + n - 1].to(torch.bfloat16).cpu(),
                      "top_ids": top.indices[trow:trow + m].int().cpu(),
                      "top_lp": top.values[trow:trow + m].half().cpu()}
            row += n
            trow += m
    return out  # type: ignore[return-value]


class FeatureStore:
    """One shard's features in memory-mapped cache files, filled as sequences are first asked for.

    lengths, prompt_lens: per sequence of the shard; key: a name unique to the shard and
    settings (see `store_key`); width: n_layers * H. Files under `folder`: `{key}.feat`
    (bfloat16 bits as uint16), `{key}.tid`, `{key}.tlp`, `{key}.done` (one byte per sequence,
    set after its rows are flushed, so an interrupted process never leaves a half-written
    sequence marked done).
    """

    def __init__(self, folder: Path, key: str, lengths: list[int], prompt_lens: list[int], width: int, top_k: int):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        n = len(lengths)
        self.feat_off = np.concatenate([[0], np.cumsum([t - 1 for t in lengths])]).astype(np.int64)
        self.top_off = np.concatenate([[0], np.cumsum([t - p for t, p in zip(lengths, prompt_lens)])]).astype(np.int64)

        def mm(suffix: str, dtype, shape):
            path = folder / f"{key}.{suffix}"
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            try:  # create at full size exactly once; a second process never truncates it
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                os.ftruncate(fd, size)
                os.close(fd)
            except FileExistsError:
                if path.stat().st_size != size:
                    raise ValueError(f"{path} holds {path.stat().st_size} bytes, expected {size}") from None
            return np.memmap(path, dtype=dtype, mode="r+", shape=shape)

        self.width, self.top_k = width, top_k
        self.feat = mm("feat", np.uint16, (int(self.feat_off[-1]), width))
        self.tid = mm("tid", np.int32, (int(self.top_off[-1]), top_k))
        self.tlp = mm("tlp", np.float16, (int(self.top_off[-1]), top_k))
        self.done = mm("done", np.uint8, (n,))

    def missing(self, indices: list[int]) -> list[int]:
        """Those of `indices` not computed yet."""
        return [i for i in indices if not self.done[i]]

    def put(self, i: int, rec: dict) -> None:
        """Store sequence i's features / top_ids / top_lp (shapes of `teacher_forced`) and mark it done.

        Raises ValueError when a shape differs from the sequence's rows.
        """
        a, b = self.feat_off[i], self.feat_off[i + 1]
        a2, b2 = self.top_off[i], self.top_off[i + 1]
        shapes = (tuple(rec["features"].shape), tuple(rec["top_ids"].shape), tuple(rec["top_lp"].shape))
        if shapes != ((b - a, self.width), (b2 - a2, self.top_k), (b2 - a2, self.top_k)):
            raise ValueError(f"sequence {i}: shapes {shapes} do not fit rows {b - a} / {b2 - a2}")
        self.feat[a:b] = rec["features"].view(torch.int16).numpy().view(np.uint16)
        self.tid[a2:b2] = rec["top_ids"].numpy()
        self.tlp[a2:b2] = rec["top_lp"].numpy()
        for m in (self.feat, self.tid, self.tlp):
            m.flush()
        self.done[i] = 1
        self.done.flush()

    def get(self, i: int) -> dict:
        """Sequence i's stored features / top_ids / top_lp as CPU tensors (copies)."""
        a, b = self.feat_off[i], self.feat_off[i + 1]
        a2, b2 = self.top_off[i], self.top_off[i + 1]
        feats = torch.from_numpy(np.array(self.feat[a:b]).view(np.int16)).view(torch.bfloat16)
        return {"features": feats, "top_ids": torch.from_numpy(np.array(self.tid[a2:b2])),
                "top_lp": torch.from_numpy(np.array(self.tlp[a2:b2]))}


def store_key(shard_sha: str, layers: tuple[int, ...], top_k: int, dtype: torch.dtype, width: int) -> str:
    """Cache file stem for a shard (its checksum) and the settings features depend on."""
    return (f"{shard_sha[:20]}-L{'_'.join(map(str, layers))}-w{width}-k{top_k}-"
            f"{str(dtype).replace('torch.', '')}")
