"""Build a ready Engine from user-facing settings (target, drafter, dtype, mode, budget)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from drafting.base import Drafter
from engine.attention import install, installed_backend, select_backend
from engine.engine import MODES, Engine, make_controller
from engine.loader import DEFAULT_TARGET, Target, load_target

log = logging.getLogger(__name__)

#: The drafter shipped for the embedded default target (trained by `bastion train-drafter`).
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "drafting" / "checkpoints" / "smollm2-dflash"


class ConfigError(ValueError):
    """Settings that cannot work together (for example a speculative mode without a drafter)."""


@dataclass
class EngineSettings:
    """User-facing engine settings; every field maps to a CLI flag and an environment variable.

    target: HF id, folder or .gguf (None: embedded default). drafter: DFlash folder or
    hub id, 'none', or None for the default (the shipped drafter of the default target).
    mode: 'ar' | 'chain' | 'tree' | 'bastion' (None: 'bastion' when a drafter exists, else 'ar').
    budget: tree size for mode 'tree'. dtype: 'float32' | 'bfloat16'. threads: torch CPU threads (0: torch default).
    """

    target: str | None = None
    drafter: str | None = None
    mode: str | None = None
    budget: int = 32
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0
    attention: str = "auto"


def default_drafter_for(target: Target) -> str | None:
    """The drafter used when none is named: for the embedded default, its shipped DFlash drafter
    merged with the suffix drafter (the merge beat DFlash alone on every set, docs/suffix.md);
    for other targets none (pass --drafter, e.g. a z-lab checkpoint or 'suffix')."""
    if target.name == DEFAULT_TARGET and (SHIPPED_DRAFTER / "config.json").is_file():
        return f"{SHIPPED_DRAFTER}+suffix"
    return None


def load_drafter(spec: str | None, target: Target) -> Drafter | None:
    """Resolve a drafter spec for `target`.

    None / 'none' -> no drafter; 'suffix' -> the training-free suffix drafter;
    'dflash' -> the shipped DFlash drafter of the target; 'X+suffix' -> DFlash X merged
    with the suffix drafter; anything else -> a DFlash checkpoint folder or hub id.
    Raises drafting.dflash.DrafterLoadError on a bad checkpoint, ConfigError when
    'dflash' is asked for a target that has no shipped drafter.
    """
    if spec is None or spec == "none":
        return None
    if spec == "suffix":
        from drafting.suffix import SuffixDrafter

        return SuffixDrafter()
    if spec.endswith("+suffix"):
        from drafting.hybrid import HybridDrafter
        from drafting.suffix import SuffixDrafter

        return HybridDrafter(load_drafter(spec[: -len("+suffix")], target), SuffixDrafter())
    if spec == "dflash":
        if target.name != DEFAULT_TARGET or not (SHIPPED_DRAFTER / "config.json").is_file():
            raise ConfigError(f"no DFlash drafter is shipped for target '{target.name}'; pass a checkpoint path")
        spec = str(SHIPPED_DRAFTER)
    from drafting.dflash import load_dflash

    return load_dflash(spec, target.model)


def build_engine(settings: EngineSettings, target: Target | None = None) -> Engine:
    """Load what the settings name and return an Engine (the controller is built for 'bastion').

    Raises ConfigError for a speculative mode without a drafter or an unknown mode;
    TargetLoadError / DrafterLoadError for bad checkpoints.
    """
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.mode is not None and settings.mode not in MODES:
        raise ConfigError(f"unknown mode '{settings.mode}' (choose from {', '.join(MODES)})")
    target = target or load_target(settings.target, settings.dtype, settings.device)
    # 'auto': sdpa on a CPU, else the fastest backend measured on the device. Plain sdpa is
    # the model's own attention with the engine's explicit tree mask: nothing to install.
    backend = select_backend(settings.attention, settings.device, config=target.config, dtype=target.dtype)
    if backend != "sdpa":
        install(target.model, backend)
    drafter_spec = settings.drafter if settings.drafter is not None else default_drafter_for(target)
    drafter = load_drafter(drafter_spec, target)
    mode = settings.mode or ("bastion" if drafter is not None else "ar")
    if mode != "ar" and drafter is None:
        raise ConfigError(
            f"mode '{mode}' needs a drafter, and none was given or shipped for target '{target.name}'; "
            "pass --drafter PATH or use --mode ar"
        )
    if mode == "ar":
        return Engine(target, None, make_controller("ar"))
    if mode == "bastion":
        return Engine(target, drafter, build_budget_controller(target, drafter, settings))
    return Engine(target, drafter, make_controller(mode, settings.budget, drafter.max_depth + 1))


def build_budget_controller(target: Target, drafter: Drafter, settings: EngineSettings, progress: bool = True,
                            **kwargs):
    """Calibrate (or load the cached calibration) and build the adaptive controller for `target`.

    The latency grid is timed through the engine's own verification path (tree mask,
    hidden-state outputs), so the fit describes what each step really runs. kwargs go to
    the BudgetController constructor; the online surrogate correction is on unless
    surrogate_correction=False is passed (it raised tokens/s on every dataset, docs/controller.md).
    """
    kwargs.setdefault("surrogate_correction", True)
    from controller.runtime import EngineController
    from engine.timing import verify_timer

    return EngineController.from_target(
        target.config, target.dtype, verify_timer(target.model, drafter.feature_layers),
        device=settings.device, model_name=target.name,
        attn_backend=installed_backend(target.model) or "sdpa",
        max_context=target.max_context, progress=progress, max_depth=drafter.max_depth, **kwargs,
    )


def add_engine_arguments(parser) -> None:
    """Add the shared engine flags; each defaults to an environment variable BASTION_<FLAG>."""
    import os

    env = os.environ.get
    parser.add_argument("--target", default=env("BASTION_TARGET"), help="HF id, model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=env("BASTION_DRAFTER"), help="DFlash checkpoint folder or HF id; 'suffix' (model-free suffix index); 'dflash' (the "
                             "target's shipped DFlash); 'X+suffix' (DFlash X merged with the suffix index); 'none' "
                             "(default for the embedded target: dflash+suffix)")
    parser.add_argument("--mode", default=env("BASTION_MODE"), choices=MODES, help="decoding mode (default: bastion with a drafter, else ar)")
    parser.add_argument("--budget", type=int, default=env("BASTION_BUDGET", "32"), help="tree size for --mode tree")
    parser.add_argument("--dtype", default=env("BASTION_DTYPE", "float32"), choices=["float32", "bfloat16"], help="weights and compute dtype")
    parser.add_argument("--device", default=env("BASTION_DEVICE", "cpu"), help="torch device (cpu, cuda)")
    parser.add_argument("--attention", default=env("BASTION_ATTENTION", "auto"),
                        choices=["auto", "sdpa", "flex", "flash_attn"],
                        help="tree attention backend (default: sdpa on CPU, else the fastest measured)")
    parser.add_argument("--threads", type=int, default=env("BASTION_THREADS", "0"), help="torch CPU threads (0: default)")


def settings_from_args(args) -> EngineSettings:
    """EngineSettings from parsed `add_engine_arguments` flags."""
    return EngineSettings(
        target=args.target,
        drafter=args.drafter,
        mode=args.mode,
        budget=args.budget,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        attention=args.attention,
    )
