"""Wire a ready Engine from user-facing settings: target, drafter, controller for the mode.

The one place a drafter spec becomes a drafter (`load_drafter`, `resolve_drafter`) and a
mode becomes a controller (`controller_for`): the server, the benchmark and calibration all
come through here.
"""
from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from bastion.settings import DRAFTER_DTYPES, MODES, EngineSettings
from controller.ceilings import device_name
from drafting.base import Drafter
from engine.attention import select_backend
from engine.engine import Engine, StepController, make_controller
from engine.loader import DEFAULT_TARGET, Target, load_target, parse_dtype

log = logging.getLogger(__name__)
#: Steps of the start-up run that gives the adaptive controller's gate its first averages
#: (`prime_gate`): each arm (draft, cheap, plain) gets a third of them, in turn.
PRIME_STEPS = 96

#: The drafter shipped for the embedded default target (trained by `bastion train-drafter`).
SHIPPED_DRAFTER = Path(__file__).resolve().parent.parent / "drafting" / "checkpoints" / "smollm2-dflash"


class ConfigError(ValueError):
    """Settings that cannot work together (for example a speculative mode without a drafter)."""


def default_drafter_for(target: Target) -> str | None:
    """The drafter used when none is named: for the embedded default, its shipped DFlash drafter
    merged with the suffix drafter (the merge beat DFlash alone on every set, docs/suffix.md);
    for other targets none (pass --drafter, e.g. a z-lab checkpoint or 'suffix')."""
    if target.name == DEFAULT_TARGET and (SHIPPED_DRAFTER / "config.json").is_file():
        return f"{SHIPPED_DRAFTER}+suffix"
    return None


def load_drafter(spec: str | None, target: Target, drafter_dtype: str = "auto") -> Drafter | None:
    """Resolve a drafter spec for `target`.

    None / 'none' -> no drafter; 'suffix' -> the training-free suffix drafter;
    'dflash' -> the shipped DFlash drafter of the target; 'X+suffix' -> DFlash X merged
    with the suffix drafter; anything else -> a DFlash checkpoint folder or hub id.
    drafter_dtype: the DFlash drafter's dtype, one of DRAFTER_DTYPES ('auto': measured by
    drafting.dflash.choose_drafter_dtype under a float32 target on a CPU, else the target's).
    Raises drafting.dflash.DrafterLoadError on a bad checkpoint, ConfigError when
    'dflash' is asked for a target that has no shipped drafter or drafter_dtype is unknown.
    """
    if spec is None or spec == "none":
        return None
    if spec == "suffix":
        from drafting.suffix import SuffixDrafter

        return SuffixDrafter()
    if spec.endswith("+suffix"):
        from drafting.hybrid import HybridDrafter
        from drafting.suffix import SuffixDrafter

        return HybridDrafter(load_drafter(spec[: -len("+suffix")], target, drafter_dtype), SuffixDrafter())
    if spec == "dflash":
        if target.name != DEFAULT_TARGET or not (SHIPPED_DRAFTER / "config.json").is_file():
            raise ConfigError(f"no DFlash drafter is shipped for target '{target.name}'; pass a checkpoint path")
        spec = str(SHIPPED_DRAFTER)
    from drafting.dflash import choose_drafter_dtype, load_dflash

    if drafter_dtype not in DRAFTER_DTYPES:
        raise ConfigError(f"unknown drafter dtype '{drafter_dtype}' (choose from {', '.join(DRAFTER_DTYPES)})")
    fixed = None if drafter_dtype in ("auto", "target") else parse_dtype(drafter_dtype)
    drafter = load_dflash(spec, target.model, dtype=fixed)
    if drafter_dtype == "auto" and target.dtype == torch.float32 and drafter.device.type == "cpu":
        # Without bfloat16 matrix units a 2-layer drafter can still run faster in bfloat16; the
        # target's verification decides what is emitted, so only the speed is at stake.
        dt, times = choose_drafter_dtype(drafter)
        log.info("drafter dtype: %s (one pass: %s)", str(dt).removeprefix("torch."),
                 ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in times.items()))
    return drafter



def build_engine(settings: EngineSettings, target: Target | None = None, max_batch: int = 1) -> Engine:
    """Load what the settings name and return an Engine (the controller is built for 'bastion').

    max_batch: sequences a server decodes together (its --max-running); dtype 'auto' then also
    times a batched step of that many sequences.

    Raises ConfigError for a speculative mode without a drafter or an unknown mode;
    TargetLoadError / DrafterLoadError for bad checkpoints.
    """
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.mode is not None and settings.mode not in MODES:
        raise ConfigError(f"unknown mode '{settings.mode}' (choose from {', '.join(MODES)})")
    # dtype 'auto' weighs what the mode verifies: one token for plain decoding, trees otherwise.
    sizes = (1,) if settings.mode == "ar" else (1, 16)
    # The machine's identity keys the kept dtype choice (engine.loader.auto_dtype).
    target = target or load_target(settings.target, settings.dtype, settings.device, auto_sizes=sizes,
                                   auto_batch=max_batch, machine=device_name(settings.device))
    # 'auto': sdpa on a CPU, else the fastest backend measured on the device.
    backend = select_backend(settings.attention, settings.device, config=target.config, dtype=target.dtype)
    drafter_spec = settings.drafter if settings.drafter is not None else default_drafter_for(target)
    drafter = load_drafter(drafter_spec, target, settings.drafter_dtype)
    mode = settings.mode or ("bastion" if drafter is not None else "ar")
    if mode != "ar" and drafter is None:
        raise ConfigError(
            f"mode '{mode}' needs a drafter, and none was given or shipped for target '{target.name}'; "
            "pass --drafter PATH or use --mode ar"
        )
    if mode == "ar":
        drafter = None
    warm_kernels(target, drafter)
    return Engine(target, drafter, controller_for(mode, target, drafter, settings, backend=backend), backend=backend)


def warm_kernels(target: Target, drafter: Drafter | None) -> float:
    """Build the CPU kernels of every tree size up front (engine.linear.warm_up over the
    target's linears and the drafter's), so that no decoding step pays for compiling one: an
    adaptive tree, a drafter's catch-up and a batch keep meeting row counts a fixed tree never
    does. Returns the seconds it took (0 off the CPU). Measured on a 2-core EPYC: 1-3 s."""
    if target.model.device.type != "cpu":
        return 0.0
    from engine.forward import target_forward_for
    from engine.linear import warm_up

    t0 = time.perf_counter()
    fwd = target_forward_for(target.model)
    linears = [lin for layer in fwd.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(fwd.lm_head)
    if drafter is not None:
        linears += drafter.linear_layers()
    calls = warm_up(linears)
    seconds = time.perf_counter() - t0
    log.info("kernels warmed: %d calls in %.1f s", calls, seconds)
    return seconds


def controller_for(mode: str, target: Target, drafter: Drafter | None, settings: EngineSettings | None = None,
                   budget: int | None = None, backend: str = "sdpa", **kwargs) -> StepController:
    """The StepController of a mode: 'ar', 'chain' (the drafter's block), 'tree' (best-first up
    to `budget` nodes, default settings.budget) or 'bastion' (the calibrated budget controller;
    kwargs go to `build_budget_controller`). Raises ConfigError for an unknown mode or a
    speculative mode without a drafter.
    """
    settings = settings or EngineSettings()
    if mode == "ar":
        return make_controller("ar")
    if mode not in MODES:
        raise ConfigError(f"unknown mode '{mode}' (choose from {', '.join(MODES)})")
    if drafter is None:
        raise ConfigError(f"mode '{mode}' needs a drafter")
    if mode == "bastion":
        return build_budget_controller(target, drafter, settings, backend=backend, **kwargs)
    if mode == "chain":
        return make_controller("chain", block_size=drafter.max_depth + 1)
    return make_controller("tree", budget if budget is not None else settings.budget)


def calibration_timers(target: Target, drafter: Drafter | None, backend: str = "sdpa"):
    """(measure(s, c), measure_batch(b, n, c)): the calibration's timers of one and of batched
    verification forwards, through the engine's own path with the drafter's feature layers
    (engine.timing.verify_timer, batch_verify_timer over controller.calibration.BATCH_GRID)."""
    from controller.calibration import BATCH_GRID
    from engine.timing import batch_verify_timer, verify_timer

    layers = drafter.feature_layers if drafter is not None else ()
    capacity = max(BATCH_GRID.c_values) + max(BATCH_GRID.n_values)
    return (verify_timer(target.model, layers, backend=backend),
            batch_verify_timer(target.model, layers, backend=backend, capacity=capacity,
                               max_batch=max(BATCH_GRID.b_values)))


def build_budget_controller(target: Target, drafter: Drafter, settings: EngineSettings, progress: bool = True,
                            backend: str = "sdpa", prime_steps: int = PRIME_STEPS, **kwargs):
    """Calibrate (or load the cached calibration) and build the adaptive controller for `target`.

    The latency grid, single and batched, is timed through the engine's own verification path
    (tree mask, hidden-state outputs), so the fit describes what each step really runs. kwargs go to
    the BudgetController constructor; the online surrogate correction is on unless
    surrogate_correction=False is passed (it raised tokens/s on every dataset, docs/controller.md).
    prime_steps: steps of the start-up run that gives the gate its first averages (`prime_gate`; 0: none).
    """
    kwargs.setdefault("surrogate_correction", True)
    from controller.budget import BudgetController

    measure, measure_batch = calibration_timers(target, drafter, backend)
    controller = BudgetController.from_target(
        target.config, target.dtype, measure, measure_batch_fn=measure_batch,
        device=settings.device, model_name=target.name, attn_backend=backend,
        max_context=target.max_context, progress=progress, max_depth=drafter.max_depth, **kwargs,
    )
    if prime_steps > 0:
        prime_gate(Engine(target, drafter, controller, backend=backend), prime_steps)
    return controller


#: Prompts of the start-up run that gives the gate its first averages (`prime_gate`): chat,
#: code and arithmetic, none from a benchmark set.
PRIME_PROMPTS = (
    "Describe how a bicycle's gears help a rider climb a hill.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Explain step by step.",
)


def prime_gate(engine: Engine, steps: int = PRIME_STEPS, prompts: tuple[str, ...] = PRIME_PROMPTS,
               max_tokens: int = 64) -> dict:
    """Give the adaptive controller's shared gate measured averages before the first request.

    Without them, the first request's gate decided from its first one or two samples of each
    arm: on the avx512_bf16 EPYC (float32) the first MT-Bench prompt committed 1.01-1.11 tokens
    a step in every benchmark run while a fixed 4-node tree committed 1.44-1.48, because one or
    two unlucky drafts (accepted lengths are geometric) put the draft arm under plain decoding
    and it was sampled again only tens of steps later (docs/controller.md, "The cold start").
    Here the engine decodes `prompts` (greedy, `max_tokens` each, EOS ignored) for `steps` steps,
    the shared gate forced to draft, use the free proposal and decode plainly in turn, so every
    arm's average starts from about steps / 3 measured samples at this machine's speed, and
    the surrogate checks and size tables from real steps. The steps run with no request's own
    gate (the shared gate decides and learns). Takes about `steps` decoding steps (3-5 s for
    the embedded target on a 2-core CPU). Returns the gate's snapshot. Raises ValueError when
    the engine's controller has no gate (not the adaptive one).
    """
    from engine.sampling import SamplingParams

    gate = getattr(engine.controller, "gate", None)
    if gate is None:
        raise ValueError("prime_gate needs the adaptive controller (controller.budget.BudgetController)")
    t0 = time.perf_counter()
    done = 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    texts = itertools.cycle(prompts)
    try:
        while done < steps:
            seq = engine.start(engine.chat_prompt_ids([{"role": "user", "content": next(texts)}]), params)
            seq.control = None  # no request gate: the shared one decides and learns
            try:
                while seq.finish_reason is None and done < steps:
                    gate.force(gate.arms[done % len(gate.arms)])
                    engine.step(seq)
                    done += 1
            finally:
                engine.release(seq)
    finally:
        gate.force(None)
    snap = gate.snapshot()
    log.info("gate primed in %.1f s over %d steps: %s", time.perf_counter() - t0, done,
             ", ".join(f"{a} {g:.2f}" for a, g in snap["gain"].items() if g is not None))
    return snap


def resolve_drafter(spec: str | None, target: Target, seed: int = 0,
                    drafter_dtype: str = "auto") -> tuple[Drafter | None, str]:
    """A drafter spec as the benchmark takes it -> (drafter or None, a description for the report).

    spec: None -> the shipped drafter of the target if any (`default_drafter_for`); 'none' -> no
    drafter; 'random' -> a random 1-layer DFlash (a lower bound: it is almost never right);
    anything else goes to `load_drafter` (with drafter_dtype). Raises what load_drafter raises.
    """
    if spec is None:
        spec = default_drafter_for(target)
        if spec is None:
            return None, "none"
    if spec == "none":
        return None, "none"
    if spec == "random":
        from drafting.dflash import random_dflash

        return (random_dflash(target.model, seed=seed, num_layers=1, mask_token_id=0),
                "random (1-layer random DFlash, lower bound)")
    return load_drafter(spec, target, drafter_dtype), spec


def no_drafter_reason(spec: str | None, target: Target) -> str:
    """Why speculative modes cannot run, with what to pass instead."""
    if spec == "none":
        return "--drafter none was given"
    return (f"no drafter is shipped for target '{target.name}' yet (expected {SHIPPED_DRAFTER} for the "
            "embedded default); pass --drafter PATH_OR_HUB_ID, or --drafter random for a random DFlash (a lower bound)")
