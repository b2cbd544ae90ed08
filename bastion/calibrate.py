"""`bastion calibrate`: fit the verification latency model on this machine and report it."""
from __future__ import annotations

from pathlib import Path


def add_arguments(p) -> None:
    from bastion.settings import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--out", default="runs/calibration", help="folder for the report (report.txt, latency.png)")
    p.add_argument("--force", action="store_true", help="recalibrate even when a matching cache exists")
    p.add_argument("--surrogate-prompts", type=int, default=3,
                   help="prompts decoded (64 tokens, drafting every step) to measure how well the drafter's raw "
                        "scores predict acceptance; 0 skips it")


#: Short prompts of three kinds for the surrogate check (our own text, no benchmark prompt).
SURROGATE_PROMPTS = (
    "Give three tips for keeping a small vegetable garden healthy.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A shop sells pens at 3 dollars each. How much do 7 pens cost? Explain step by step.",
)


def measure_surrogate(engine_target, drafter, model, prompt_ids: list[list[int]], max_tokens: int = 64):
    """Decode each prompt greedily with the adaptive policy on raw drafter scores, drafting at
    every step, and return the controller's SurrogateCalibrator (predicted A_hat vs realised
    accepted length, per-depth reliability; controller/surrogate.py).

    engine_target: a loaded Target; drafter: a Drafter; model: the calibrated LatencyModel.
    """
    from prometheus_client import CollectorRegistry

    from controller.gate import SpeculationGate
    from controller.policy import default_settings
    from controller.budget import BudgetController
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    controller = BudgetController(model, default_settings(engine_target.model.device), registry=CollectorRegistry(),
                           max_depth=drafter.max_depth, surrogate_correction=False,
                           gate=SpeculationGate(arms=("draft",)))  # always draft: every step is a sample
    eng = Engine(engine_target, drafter, controller)
    for ids in prompt_ids:
        eng.generate(ids, SamplingParams(max_tokens=max_tokens))
    return controller.surrogate


def run(args) -> int:
    """Time target forwards through the engine's verify path over the device grid, fit, print, plot.

    The fit is cached (keyed by device, model, dtype, attention backend, torch version) and
    reused by the server; --force refits.
    """
    import torch

    from controller.calibration import calibrate, report
    from bastion.factory import calibration_timers, default_drafter_for, load_drafter
    from bastion.settings import settings_from_args
    from engine.loader import load_target

    st = settings_from_args(args)
    if st.threads:
        torch.set_num_threads(st.threads)
    target = load_target(st.target, st.dtype, st.device)
    # Time the same forward the server runs: with the default drafter's hidden-state outputs.
    drafter = load_drafter(st.drafter if st.drafter is not None else default_drafter_for(target), target)
    measure, measure_batch = calibration_timers(target, drafter)
    result = calibrate(measure, target.config, target.dtype, device=st.device,
                       model_name=target.name, attn_backend="sdpa", use_cache=not args.force,
                       max_context=target.max_context, progress=True, measure_batch_fn=measure_batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = None
    if drafter is not None and args.surrogate_prompts > 0:
        from engine.engine import Engine, make_controller

        enc = Engine(target, None, make_controller("ar")).chat_prompt_ids
        ids = [enc([{"role": "user", "content": p}]) for p in SURROGATE_PROMPTS[: args.surrogate_prompts]]
        extra = measure_surrogate(target, drafter, result.model(), ids).summary()
    text = report(result, out / "latency.png", extra=extra)
    (out / "report.txt").write_text(text + "\n")
    print(f"report: {out / 'report.txt'}  plot: {out / 'latency.png'}")
    return 0
