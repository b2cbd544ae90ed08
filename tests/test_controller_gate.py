"""SpeculationGate: three arms by realised gain, exploration with a floor, bounded reaction times."""
import numpy as np
import pytest

from controller.gate import INHERIT_SAMPLES, SpeculationGate


def run(gate: SpeculationGate, gains: dict, steps: int, rng=None) -> list[str]:
    """Play `steps` steps; gains[arm] is a number or a callable(rng) -> number. Returns the arms used."""
    used = []
    for _ in range(steps):
        arm = gate.choice()
        g = gains.get(arm, 1.0)
        gate.record(arm, g(rng) if callable(g) else g)
        used.append(arm)
    return used


def test_untried_arms_first_then_the_best_and_ties_go_to_plain():
    g = SpeculationGate()
    assert g.choice() == "draft"
    g.record("draft", 0.8)
    assert g.choice() == "cheap"  # never tried yet
    g.record("cheap", 1.0 - g.plain_margin)
    assert g.best() == "plain" and g.choice() == "plain"  # cheap ties plain at 1 - margin: plain wins ties
    assert g.value("plain") == pytest.approx(0.9) and g.gain["plain"] == 1.0
    g.record("plain", 5.0)  # a plain step's gain is 1 by definition, whatever is passed
    assert g.gain["plain"] == 1.0
    g2 = SpeculationGate(arms=("draft",))
    assert g2.choice() == "draft" and g2.arms == ("draft",)
    with pytest.raises(ValueError):
        g2.record("plain")
    for bad in ({"arms": ()}, {"arms": ("fast",)}, {"alpha": 0.0}, {"explore_every": 0}, {"slow_alpha": 1.5},
                {"shift_sigmas": 0.0}, {"plain_margin": 1.0}, {"plain_margin": -1.0}):
        with pytest.raises(ValueError):
            SpeculationGate(**bad)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            g.record("draft", bad)
    t = g.t
    g.tick()  # a step that used none of the arms: time passes, nothing else
    assert g.t == t + 1 and g.samples["draft"] == 1


def test_the_first_samples_are_averaged_then_the_averages_are_exponential():
    g = SpeculationGate(alpha=0.15, slow_alpha=0.06, shift_sigmas=1e9)  # no shifts: the two plain averages
    g.record("draft", 2.0)
    g.record("draft", 1.0)
    assert g.gain["draft"] == pytest.approx(1.5) and g.fast["draft"] == pytest.approx(1.5)  # weight 1/2
    for _ in range(20):
        g.record("draft", 1.0)
    before, before_fast = g.gain["draft"], g.fast["draft"]
    g.record("draft", 3.0)
    assert g.gain["draft"] == pytest.approx(before + 0.06 * (3.0 - before))
    assert g.fast["draft"] == pytest.approx(before_fast + 0.15 * (3.0 - before_fast))
    assert g.shifts == 0


def test_the_decision_average_follows_the_fast_one_when_they_part():
    """Noisy gains around 1.5 (sd 0.3), then a drop to 0.6: the slow average alone would need
    about 14 samples to fall under the free proposals' 1.1; it jumps to the fast one instead."""
    rng = np.random.default_rng(0)
    g = SpeculationGate(alpha=0.15, slow_alpha=0.06)
    for _ in range(300):
        g.record("draft", float(rng.normal(1.5, 0.3)))
    assert g.gain["draft"] == pytest.approx(1.5, abs=0.15)
    quiet_shifts = g.shifts
    assert quiet_shifts <= 6  # steady noise rarely moves it (2.5 standard errors)
    for i in range(1, 20):
        g.record("draft", 0.6)
        if g.gain["draft"] < 1.1:
            break
    assert i <= 8 and g.shifts > quiet_shifts and g.gain["draft"] == pytest.approx(g.fast["draft"], abs=0.05)


def test_near_ties_keep_the_drafter_and_the_margin_bounds_the_loss():
    """Simulated accepted lengths (geometric, as they are) at a step 1.35 plain steps long: across
    drafter gains 0.8-1.6 the realised throughput stays within 2.5 % of the better of drafting
    and plain decoding. A single fast average without the margin lost 11 % at a gain of 1.22."""
    def realised(mean_accepted: float, seed: int, **kw) -> float:
        rng = np.random.default_rng(seed)
        g = SpeculationGate(arms=("draft", "plain"), **kw)
        p = (mean_accepted - 1) / mean_accepted
        tokens = time = 0.0
        for _ in range(3000):
            if g.choice() == "draft":
                acc = int(rng.geometric(1 - p))
                g.record("draft", acc * 0.74, 1 / 0.74)
                tokens, time = tokens + acc, time + 1 / 0.74
            else:
                g.record("plain")
                tokens, time = tokens + 1, time + 1
        return tokens / time / max(1.0, 0.74 * mean_accepted)
    for m in (1.1, 1.2, 1.3, 1.42, 1.65, 2.2):
        assert np.mean([realised(m, s) for s in range(6)]) >= 0.975, m
    old = np.mean([realised(1.65, s, slow_alpha=0.15, plain_margin=0.0) for s in range(6)])
    assert old < 0.93  # the single fast average this replaced


def test_losing_arms_are_sampled_at_least_at_the_floor_rate_and_cost_within_the_bound():
    g = SpeculationGate(explore_every=32)
    gains = {"draft": 0.4, "cheap": 0.9, "plain": 1.0}
    used = run(g, gains, 3200)
    assert g.period("draft") == 32 and g.period("cheap") == 8  # far loser: the floor; near: every MIN_PERIOD
    assert used.count("draft") >= 0.95 * 3200 / 32  # at least once per E steps (less the collisions)
    assert 0.85 * 3200 / 8 <= used.count("cheap") <= 3200 / 8 + 1
    # per losing arm: gap / (1 + 2 E gap) below a gap of 1/2 (cheap), gap / E beyond (draft)
    n = len(used)
    assert used.count("cheap") * 0.1 / n <= 0.1 / (1 + 2 * 32 * 0.1) + 1e-3
    assert used.count("draft") * 0.6 / n <= 0.6 / 32 + 1e-3


def test_long_losing_steps_are_sampled_less_often_so_their_time_cost_stays_bounded():
    """A draft step 5 plain steps long at gain 0.28 (an 8-node tree in bfloat16 without AMX: 1.37
    tokens in 4.9 plain steps) loses 3.6 plain steps a sample; its period stretches by
    r = min(5, R_MAX) so the time it costs stays near the gap / E bound."""
    from controller.gate import R_MAX

    E = 32
    g = SpeculationGate(explore_every=E, arms=("draft", "plain"))
    lengths = {"draft": 5.0, "plain": 1.0}
    gains = {"draft": 0.28, "plain": 1.0}
    lost = spent = 0.0
    for _ in range(20000):
        a = g.choice()
        g.record(a, gains[a], lengths[a])
        spent += lengths[a]
        lost += lengths[a] * (1.0 - gains[a])  # plain steps' worth of output it did not produce
    assert g.period("draft") == int(E * R_MAX)
    assert lost / spent <= 0.72 * (5.0 / R_MAX) / E + 2e-3  # (r / R_MAX) gap / E
    unscaled = SpeculationGate(explore_every=E, arms=("draft", "plain"))
    for _ in range(4):
        unscaled.record("draft", gains["draft"])  # no lengths: the period of equal-length steps
    assert unscaled.period("draft") == E
    with pytest.raises(ValueError):
        g.record("draft", 0.5, 0.0)


def test_a_useless_drafter_is_turned_down_within_six_steps_and_a_useful_one_back_up_in_bounded_steps():
    g = SpeculationGate(explore_every=32)
    run(g, {"draft": 1.5, "cheap": 1.1}, 100)
    assert g.best() == "draft"
    # the drafter becomes useless (a hard prompt): at most six more drafted steps
    used = run(g, {"draft": 0.6, "cheap": 1.1}, 40)
    first_other = next(i for i, a in enumerate(used) if a != "draft")
    assert first_other <= 6
    assert g.best() == "cheap"
    run(g, {"draft": 0.6, "cheap": 1.1}, 500)  # a long bad stretch does not lock drafting out ...
    used = run(g, {"draft": 1.5, "cheap": 1.1}, 80)
    # ... it is sampled within explore_every steps, and each winning sample is followed at once
    back = next(i for i in range(len(used)) if all(a == "draft" for a in used[i:i + 10]))
    assert back <= g.explore_every + 6 and g.best() == "draft"
    # the rest: exploring the two losers, each behind by >= 27 %, once per 1 + 2 E gap >= 18 steps
    assert used[-40:].count("draft") >= 40 - 2 * (40 // 18 + 1)


@pytest.mark.parametrize("seed", range(20))
def test_no_history_keeps_drafting_off_for_more_than_a_bounded_fraction_once_it_pays(seed):
    """Any start (random arms' gains, some absurd), then drafting pays with noisy gains (1.2-1.8
    against free proposals at 0.9-1.2): after a bounded warm-up, the steps off the drafter are
    the two losers' exploration, each at most 1 / (1 + 2 E gap) of the steps (gap >= 0.2 on
    average), and they cost at most 1 / (2 E) each of the drafter's throughput."""
    rng = np.random.default_rng(seed)
    g = SpeculationGate(explore_every=32)
    adversarial = {"draft": lambda r: float(r.choice([0.0, 0.1, 3.0, 0.5])),
                   "cheap": lambda r: float(r.uniform(0, 4))}
    run(g, adversarial, int(rng.integers(1, 400)), rng)
    paying = {"draft": lambda r: float(r.uniform(1.2, 1.8)), "cheap": lambda r: float(r.uniform(0.9, 1.2))}
    used = run(g, paying, 1000, rng)
    warm = 2 * g.explore_every
    tail = used[warm:]
    off = sum(a != "draft" for a in tail) / len(tail)
    assert off <= 2 / (1 + 2 * g.explore_every * 0.2) + 0.02
    mean = {"draft": 1.5, "cheap": 1.05, "plain": 1.0}
    realised = sum(mean[a] for a in tail) / len(tail)
    assert realised >= 1.5 * (1 - 2 / (2 * g.explore_every)) - 0.02


def test_state_carries_and_a_new_class_inherits_its_neighbours_averages():
    a = SpeculationGate()
    run(a, {"draft": 0.5, "cheap": 1.3}, 10)
    b = SpeculationGate()
    b.inherit(a)
    assert b.gain == a.gain and b.samples == {"draft": 0, "cheap": 0, "plain": 0}
    assert b.choice() == "cheap"
    snap = b.snapshot()
    assert snap["choice"] == "cheap" and snap["gain"]["draft"] == a.gain["draft"]
    b.record("cheap", 0.5)  # the inherited average counts as INHERIT_SAMPLES samples
    w = max(b.alpha, 1 / (INHERIT_SAMPLES + 1))
    assert b.gain["cheap"] == pytest.approx(a.gain["cheap"] + w * (0.5 - a.gain["cheap"]))


def test_an_arm_with_few_samples_is_rechecked_sooner():
    """One bad first sample must not lock an arm out for the full period: with n < CONFIDENT_SAMPLES
    samples the period is n / CONFIDENT_SAMPLES of it (never below MIN_PERIOD)."""
    from controller.gate import CONFIDENT_SAMPLES, MIN_PERIOD

    g = SpeculationGate(explore_every=64, arms=("draft", "plain"))
    g.record("draft", 0.35, 2.8)  # a cold first draft: gain 0.35 in 2.8 plain steps
    full = int(min(64 * 2.8, max(MIN_PERIOD, 1 + 2 * 64 * 2.8 * 0.65)))
    assert full == 179 and g.period("draft") == int(full / CONFIDENT_SAMPLES)
    waited = 0
    while not g.should_draft():
        g.record("plain")
        waited += 1
    assert waited == int(full / CONFIDENT_SAMPLES)
    g.record("draft", 0.35, 2.8)
    assert g.period("draft") == int(full * 2 / CONFIDENT_SAMPLES)
    for _ in range(2):
        g.record("draft", 0.35, 2.8)
    assert g.period("draft") == full
    near = SpeculationGate(explore_every=64, arms=("draft", "plain"))
    near.record("draft", 0.99, 1.0)  # a near-tie keeps the MIN_PERIOD floor
    assert near.period("draft") == MIN_PERIOD


def test_a_request_samples_an_inherited_losing_arm_early_and_takes_it_when_it_pays_there():
    """Averages inherited from earlier requests (a prompt set where drafts lost) must not decide a
    new request alone: its own gate samples such an arm MIN_PERIOD steps in, once, and a request
    where that arm pays makes it the best within a few more steps (each winning sample is
    followed at once); where the arm keeps losing, the next sample waits the full period."""
    from controller.gate import MIN_PERIOD

    shared = SpeculationGate()
    for _ in range(40):  # what earlier requests measured: drafts at 0.8, free trees at 1.4
        shared.record("draft", 0.8, 1.6)
        shared.record("cheap", 1.4, 1.0)
    assert shared.best() == "cheap" and shared.period("draft") > 5 * MIN_PERIOD
    pays = SpeculationGate()
    pays.inherit(shared)
    assert pays.period("draft") == MIN_PERIOD
    used = run(pays, {"draft": 1.9, "cheap": 1.4}, 30)
    assert "draft" not in used[:MIN_PERIOD] and used[MIN_PERIOD] == "draft"
    assert pays.best() == "draft" and used[-10:] == ["draft"] * 10
    loses = SpeculationGate()
    loses.inherit(shared)
    used = run(loses, {"draft": 0.8, "cheap": 1.4}, 60)
    assert used.count("draft") == 1 and used[MIN_PERIOD] == "draft"
    assert loses.period("draft") > 5 * MIN_PERIOD


def test_force_makes_every_choice_until_released_and_sample_the_next_one():
    g = SpeculationGate()
    g.record("draft", 2.0, 1.2)
    g.record("cheap", 1.5, 1.0)
    assert g.choice() == "draft"
    g.force("plain")
    assert g.choice() == "plain" and not g.should_draft()
    g.record("plain")
    assert g.choice() == "plain"
    g.sample("cheap")
    assert g.choice() == "plain"  # a forced arm comes first
    g.force(None)
    assert g.choice() == "cheap"  # the sample, once
    g.record("cheap", 1.5, 1.0)
    assert g.choice() == "draft"
    g.sample("plain")
    g.tick()  # a step that used no arm clears it too
    assert g.choice() == "draft"
    with pytest.raises(ValueError, match="unknown arm"):
        SpeculationGate(arms=("draft", "plain")).force("cheap")
    with pytest.raises(ValueError, match="unknown arm"):
        SpeculationGate(arms=("draft", "plain")).sample("cheap")
