"""An evaluation's prompt set (conf/prompts/): the file or the built-in prompts, then the categories and the
limit it asks for."""

from __future__ import annotations

from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from selfspec.data import builtin_prompts, load_prompts
from selfspec.errors import SelfSpecError, check
from selfspec.evaluation.config import PromptSetConfig
from selfspec.utils.config import build

# Spec-Bench's multi-turn task is MT-bench, whose questions carry MT-bench's own eight categories.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def prompt_set_config(node) -> PromptSetConfig:
    """The `prompts` node (a Hydra node or a dict) as a PromptSetConfig; unknown keys are refused."""
    if isinstance(node, DictConfig) and OmegaConf.is_missing(node, "path"):
        raise SelfSpecError("prompts.path: required for this prompt set (prompts.path=FILE)")
    return build(PromptSetConfig, node, "prompts")


def load_prompt_set(cfg: PromptSetConfig) -> list:
    """-> PromptItems in file order: categories kept, then `limit` in total or per category."""
    items = builtin_prompts(key="prompts") if cfg.path is None else load_prompts(cfg.path, fmt=cfg.format, key="prompts")
    if cfg.spec_bench_tasks:
        # Spec-Bench reports six tasks; its MT-bench part spreads over eight categories of 10 questions each.
        items = [replace(it, category="mt_bench", source_category=it.category) if it.category in MT_BENCH_CATEGORIES else it
                 for it in items]
    present = list(dict.fromkeys(it.category for it in items))
    if cfg.categories:
        unknown = [c for c in cfg.categories if c not in present]
        check(not unknown, f"prompts.categories: {unknown} not in the prompt set; present: {', '.join(present)}")
        items = [it for it in items if it.category in set(cfg.categories)]
    if cfg.limit is not None:
        if cfg.per_category:
            seen: dict[str, int] = {}
            kept = []
            for it in items:
                seen[it.category] = seen.get(it.category, 0) + 1
                if seen[it.category] <= cfg.limit:
                    kept.append(it)
            items = kept
        else:
            items = items[: cfg.limit]
    check(len(items) > 0, "prompts: no prompts selected")
    return items
