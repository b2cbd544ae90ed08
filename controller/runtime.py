"""The adaptive controller as the engine's per-step StepController (mode `bastion`)."""
from __future__ import annotations

from controller.budget import BudgetController
from controller.surrogate import depth_mass


class EngineController(BudgetController):
    """BudgetController plus the engine-facing `observe(stats, tree)` hook.

    The engine calls policy_for_step / should_draft / correct before a step and
    observe after it; observe forwards the step's sizes and timings to record_step.
    """

    def observe(self, stats, tree) -> None:
        """stats: engine StepStats; tree: the verified Tree (depths, log_scores)."""
        proposed = stats.drafted or stats.cheap
        mass = depth_mass(tree.depths, tree.log_scores, self.surrogate.max_depth) if proposed else None
        self.record_step(stats.tree_size, stats.context_len, stats.verify_s, stats.draft_s, stats.other_s,
                         stats.a_hat, stats.accepted, drafted=stats.drafted, depth_mass=mass, cheap=stats.cheap)
