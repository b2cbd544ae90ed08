"""Session fixtures: the embedded default target is loaded once per test session."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def target_f32():
    """SmolLM2-135M-Instruct (embedded default), float32."""
    from engine.loader import load_target

    return load_target(dtype="float32")


@pytest.fixture(scope="session")
def random_drafter(target_f32):
    """A randomly initialised 1-layer DFlash drafter for the default target (low acceptance)."""
    from drafting.dflash import random_dflash

    return random_dflash(target_f32.model, seed=0, num_layers=1, mask_token_id=0)
