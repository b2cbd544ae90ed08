"""User-facing engine settings and the one way environment defaults are read.

Every flag `--some-flag` of every command defaults to the environment variable
`BASTION_SOME_FLAG` when it is set (`env_default`). Defaults stay strings so argparse
converts them with the flag's own type: a bad value is a clean usage error of that command.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

#: Decoding modes of the engine: the fixed ones (engine.engine.FIXED_MODES) plus the adaptive one.
MODES = ("ar", "chain", "tree", "bastion")
#: Values of --drafter-dtype: 'target' keeps the target's dtype, 'auto' measures (bastion.factory.load_drafter).
DRAFTER_DTYPES = ("auto", "target", "float32", "bfloat16")


def env_default(name: str, default: str | None) -> str | None:
    """The value of BASTION_<NAME> (name as in the flag, upper-cased, '-' -> '_'), else `default`."""
    return os.environ.get("BASTION_" + name.upper().replace("-", "_"), default)


@dataclass
class EngineSettings:
    """User-facing engine settings; every field maps to a CLI flag and an environment variable.

    target: HF id, folder or .gguf (None: embedded default). drafter: a drafter spec
    (bastion.factory.load_drafter), or None for the default (the shipped drafter of the
    default target). mode: one of MODES (None: 'bastion' when a drafter exists, else 'ar').
    budget: tree size for mode 'tree'. dtype: 'auto' | 'float32' | 'bfloat16'. device: torch device.
    threads: torch CPU threads (0: torch default). attention: tree attention backend.
    drafter_dtype: 'auto' | 'target' | 'float32' | 'bfloat16', the DFlash drafter's compute dtype
    (auto: bfloat16 under a float32 target on a CPU when its pass is measured faster, else the target's).
    """

    target: str | None = None
    drafter: str | None = None
    mode: str | None = None
    budget: int = 32
    dtype: str = "auto"
    device: str = "cpu"
    threads: int = 0
    attention: str = "auto"
    drafter_dtype: str = "auto"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the shared engine flags; each defaults to its environment variable BASTION_<FLAG>."""
    env = env_default
    parser.add_argument("--target", default=env("target", None),
                        help="HF id, model folder or .gguf (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=env("drafter", None),
                        help="DFlash checkpoint folder or HF id; 'suffix' (model-free suffix index); 'dflash' (the "
                             "target's shipped DFlash); 'X+suffix' (DFlash X merged with the suffix index); 'none' (no "
                             "drafter). Default: dflash+suffix for the embedded target")
    parser.add_argument("--mode", default=env("mode", None), choices=MODES,
                        help="decoding mode (default: bastion with a drafter, else ar)")
    parser.add_argument("--budget", type=int, default=env("budget", "32"), help="tree size for --mode tree")
    parser.add_argument("--dtype", default=env("dtype", "auto"), choices=["auto", "float32", "bfloat16"],
                        help="weights and compute dtype (auto: the cheaper verification on this machine, "
                             "measured at start-up)")
    parser.add_argument("--device", default=env("device", "cpu"), help="torch device (cpu, cuda)")
    parser.add_argument("--attention", default=env("attention", "auto"),
                        choices=["auto", "sdpa", "flex", "flash_attn"],
                        help="tree attention backend (default: sdpa on CPU, else the fastest measured)")
    parser.add_argument("--threads", type=int, default=env("threads", "0"), help="torch CPU threads (0: default)")
    parser.add_argument("--drafter-dtype", default=env("drafter-dtype", "auto"),
                        choices=DRAFTER_DTYPES,
                        help="DFlash drafter dtype (auto: bfloat16 under a float32 target on a CPU when its pass is "
                             "measured faster; the output never depends on it, only the acceptance)")


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """EngineSettings from parsed `add_engine_arguments` flags."""
    return EngineSettings(target=args.target, drafter=args.drafter, mode=args.mode, budget=args.budget,
                          dtype=args.dtype, device=args.device, threads=args.threads, attention=args.attention,
                          drafter_dtype=args.drafter_dtype)
