"""Token shards: the drafter's training data as compact files that live in git.

A data folder (default `data/drafter/`, committed) holds:

    manifest.json          format, target identity, and per shard: file, sha256, sequences,
                           prompt and response token counts, sequences per prompt source
    shard_NNNNN.safetensors
        tokens       uint16 [T]      every sequence's prompt + response ids, concatenated
        offsets      int64  [n + 1]  sequence i is tokens[offsets[i]:offsets[i + 1]]
        prompt_lens  int32  [n]      the first prompt_lens[i] ids of sequence i are the prompt
        sources      uint8  [n]      index into the manifest's `sources` list (template, magpie, ...)
        ended        uint8  [n]      1 when the response ended with the target's EOS

Two bytes a token (uint16 holds any id below 65,536; `write_shard` refuses larger ids).
Features are never stored here: they live in a cache outside git (training.features),
filled by the data stage as it decodes, or on another machine by a teacher-forced pass.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

FORMAT = 1
MANIFEST = "manifest.json"
#: Where the committed data lives, relative to the repository root.
DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "drafter"


class ShardError(ValueError):
    """A shard or manifest is missing, malformed or fails its checksum (the message says which)."""


@dataclass
class Sequence:
    """One training sequence: ids [T] int64 (prompt + response), prompt_len, source name, ended."""

    ids: np.ndarray
    prompt_len: int
    source: str
    ended: bool

    @property
    def response_len(self) -> int:
        """Tokens after the prompt."""
        return int(len(self.ids) - self.prompt_len)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    """The folder's manifest, or an empty one (no shards) when the folder has none.

    Raises ShardError for a manifest of another format.
    """
    path = Path(folder) / MANIFEST
    if not path.exists():
        return {"format": FORMAT, "target": None, "sources": [], "shards": []}
    man = json.loads(path.read_text())
    if man.get("format") != FORMAT:
        raise ShardError(f"{path}: format {man.get('format')!r}, expected {FORMAT}")
    return man


def _write_manifest(folder: Path, man: dict) -> None:
    man["totals"] = {k: sum(s[k] for s in man["shards"])
                     for k in ("sequences", "prompt_tokens", "response_tokens")}
    tmp = Path(folder) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(man, indent=1) + "\n")
    os.replace(tmp, Path(folder) / MANIFEST)


def write_shard(folder: Path, sequences: list[Sequence], target: str, meta: dict | None = None) -> dict:
    """Append `sequences` as the next shard of `folder` and record it in the manifest.

    target: identity of the model that wrote the responses (a folder holds one target's
    data). meta: extra settings kept in the manifest entry (generation dtype, max tokens).
    Returns the manifest entry. Raises ShardError for an empty list, an id that does not
    fit uint16, a prompt longer than its sequence, or a folder holding another target's data.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not sequences:
        raise ShardError("a shard needs at least one sequence")
    man = read_manifest(folder)
    if man["target"] not in (None, target):
        raise ShardError(f"{folder} holds data of target {man['target']!r}, not {target!r}")
    man["target"] = target
    ids = [np.asarray(s.ids, dtype=np.int64) for s in sequences]
    top = max(int(a.max()) for a in ids if len(a))
    if top >= 1 << 16 or min(int(a.min()) for a in ids if len(a)) < 0:
        raise ShardError(f"token id {top} does not fit a uint16 shard")
    if any(not 0 < s.prompt_len <= len(a) for s, a in zip(sequences, ids)):
        raise ShardError("every sequence needs 0 < prompt_len <= its length")
    for s in sequences:
        if s.source not in man["sources"]:
            man["sources"].append(s.source)
    index = len(man["shards"])
    name = f"shard_{index:05d}.safetensors"
    arrays = {
        "tokens": np.concatenate(ids).astype(np.uint16),
        "offsets": np.concatenate([[0], np.cumsum([len(a) for a in ids])]).astype(np.int64),
        "prompt_lens": np.asarray([s.prompt_len for s in sequences], dtype=np.int32),
        "sources": np.asarray([man["sources"].index(s.source) for s in sequences], dtype=np.uint8),
        "ended": np.asarray([bool(s.ended) for s in sequences], dtype=np.uint8),
    }
    tmp = folder / (name + ".tmp")
    save_file(arrays, str(tmp), metadata={"format": str(FORMAT), "target": target})
    os.replace(tmp, folder / name)
    prompt_tokens = sum(s.prompt_len for s in sequences)
    per_source: dict[str, int] = {}
    for s in sequences:
        per_source[s.source] = per_source.get(s.source, 0) + 1
    entry = {"file": name, "sha256": sha256_of(folder / name), "sequences": len(sequences),
             "prompt_tokens": int(prompt_tokens), "response_tokens": int(sum(len(a) for a in ids) - prompt_tokens),
             "per_source": per_source, **(meta or {})}
    man["shards"].append(entry)
    _write_manifest(folder, man)
    return entry


def read_shard(folder: Path, entry: dict, sources: list[str], verify: bool = True) -> list[Sequence]:
    """The sequences of one manifest entry. Raises ShardError when the file is missing or its
    sha256 differs from the manifest's (verify=True) or its arrays disagree."""
    path = Path(folder) / entry["file"]
    if not path.exists():
        raise ShardError(f"{path} is missing")
    if verify and sha256_of(path) != entry["sha256"]:
        raise ShardError(f"{path}: checksum differs from the manifest")
    a = load_file(str(path))
    off, pl = a["offsets"], a["prompt_lens"]
    n = len(pl)
    if len(off) != n + 1 or off[-1] != len(a["tokens"]) or len(a["sources"]) != n or len(a["ended"]) != n \
            or np.any(np.diff(off) < pl) or np.any(pl < 1) or (n and int(a["sources"].max()) >= len(sources)):
        raise ShardError(f"{path}: arrays of inconsistent lengths or indices")
    toks = a["tokens"].astype(np.int64)
    return [Sequence(toks[off[i]:off[i + 1]], int(pl[i]), sources[int(a["sources"][i])], bool(a["ended"][i]))
            for i in range(n)]


def read_all(folder: Path = DEFAULT_DATA_DIR, verify: bool = True) -> list[Sequence]:
    """Every sequence of every shard in manifest order. Raises ShardError as `read_shard`."""
    man = read_manifest(folder)
    out: list[Sequence] = []
    for entry in man["shards"]:
        out.extend(read_shard(folder, entry, man["sources"], verify))
    return out
