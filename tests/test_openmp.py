"""The OpenMP wait-policy and oneDNN kernel-cache defaults of the `bastion` package (bastion/openmp.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import torch  # noqa: F401 - imported first on purpose: apply_defaults must then refuse

from bastion.openmp import DEFAULTS, apply_defaults


def _env_without_openmp() -> dict:
    return {k: v for k, v in os.environ.items() if k not in DEFAULTS}


def test_importing_bastion_sets_the_defaults_before_torch_and_a_users_value_wins():
    code = ("import os, bastion, torch; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], "
            "os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])")
    out = subprocess.run([sys.executable, "-c", code], env={**_env_without_openmp(), "GOMP_SPINCOUNT": "5"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ACTIVE", "5", "16384"]
    out = subprocess.run([sys.executable, "-c", code], env=_env_without_openmp(), capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["ACTIVE", "2000000", "16384"]


def test_defaults_are_not_applied_once_torch_is_loaded():
    env: dict = {}
    assert apply_defaults(env) is False
    assert env == {}
