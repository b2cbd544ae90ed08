"""`bastion calibrate`: fit the verification latency model on this machine and report it."""
from __future__ import annotations

from pathlib import Path


def add_arguments(p) -> None:
    from engine.factory import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--out", default="runs/calibration", help="folder for the report (report.txt, latency.png)")
    p.add_argument("--force", action="store_true", help="recalibrate even when a matching cache exists")


def run(args) -> int:
    """Time target forwards through the engine's verify path over the device grid, fit, print, plot.

    The fit is cached (keyed by device, model, dtype, attention backend, torch version) and
    reused by the server; --force refits.
    """
    import torch

    from controller.calibration import calibrate, report
    from engine.factory import default_drafter_for, load_drafter, settings_from_args
    from engine.loader import load_target
    from engine.timing import verify_timer

    st = settings_from_args(args)
    if st.threads:
        torch.set_num_threads(st.threads)
    target = load_target(st.target, st.dtype, st.device)
    # Time the same forward the server runs: with the default drafter's hidden-state outputs.
    drafter = load_drafter(st.drafter if st.drafter is not None else default_drafter_for(target), target)
    layers = drafter.feature_layers if drafter is not None else ()
    result = calibrate(verify_timer(target.model, layers), target.config, target.dtype, device=st.device,
                       model_name=target.name, attn_backend="sdpa", use_cache=not args.force,
                       max_context=target.max_context, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(result, out / "latency.png")
    (out / "report.txt").write_text(text + "\n")
    print(f"report: {out / 'report.txt'}  plot: {out / 'latency.png'}")
    return 0
