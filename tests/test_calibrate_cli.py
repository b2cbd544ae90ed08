"""`bastion calibrate`'s surrogate check: raw drafter scores against realised acceptance."""
from controller.ceilings import Ceilings
from controller.cost_model import ModelShape
from controller.latency_model import LatencyModel, LatencyParams
from bastion.calibrate import measure_surrogate
from helpers import tiny_target


def test_surrogate_check_drafts_every_step_and_reports_reliability():
    from drafting.dflash import random_dflash

    target = tiny_target(vocab=16)
    drafter = random_dflash(target.model, num_layers=1, mask_token_id=0)
    shape = ModelShape.from_config(target.config, target.dtype)
    model = LatencyModel(shape, Ceilings(50e9, 10e9, "synthetic"), LatencyParams(1.0, 1e-4, 1.0, 1e-4))
    sur = measure_surrogate(target, drafter, model, [[1, 2, 3], [4, 5, 6, 7]], max_tokens=12)
    # every step of both requests drafted (threshold 0 never pauses); the last step of each
    # request has room for one token only, so it is a plain step and records nothing
    assert 2 <= sur.steps <= 2 * 11
    assert sur.mean_predicted >= 1.0 and sur.mean_realised >= 1.0
    text = sur.summary()
    assert "mean A_hat" in text and "reliability" in text and "correction off" in text
