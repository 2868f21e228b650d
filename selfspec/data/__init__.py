"""Prompt data that training and evaluation share: loaders for prompt files (Spec-Bench, ShareGPT, plain prompts) and
a built-in set (prompts.py), the evaluation prompts training data must not contain (exclude.py, excluded/) and
normalized-text dedup and n-gram overlap (dedup.py). Building training data is training's (training/mix/)."""

from selfspec.data.prompts import PromptItem, builtin_prompts, load_prompts

__all__ = ["PromptItem", "builtin_prompts", "load_prompts"]
