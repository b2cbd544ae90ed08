"""The published target/drafter pairs (SPEC section 2) and how each target's chat template is applied."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PublishedPair:
    """A Hugging Face target and its z-lab DFlash drafter.

    chat_template_kwargs: extra keywords for tokenizer.apply_chat_template (the Qwen3
    drafters were trained without thinking traces, so thinking is disabled).
    """

    target: str
    drafter: str
    chat_template_kwargs: dict = field(default_factory=dict)


PUBLISHED_PAIRS: tuple[PublishedPair, ...] = (
    PublishedPair("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", {"enable_thinking": False}),
    PublishedPair("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", {"enable_thinking": False}),
    PublishedPair("meta-llama/Llama-3.1-8B-Instruct", "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
)


def published_drafter(target: str) -> str | None:
    """The z-lab drafter published for a target hub id (None when there is none)."""
    return next((p.drafter for p in PUBLISHED_PAIRS if p.target == target), None)


def chat_template_kwargs(target_name: str, config=None) -> dict:
    """Keywords for apply_chat_template: {'enable_thinking': False} for every Qwen3 target.

    Matched by the published id, else by config.model_type == 'qwen3' (a local copy of a
    Qwen3 checkpoint). Templates that do not use the variable ignore it.
    """
    for p in PUBLISHED_PAIRS:
        if p.target == target_name:
            return dict(p.chat_template_kwargs)
    if getattr(config, "model_type", None) == "qwen3":
        return {"enable_thinking": False}
    return {}
