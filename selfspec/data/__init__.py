"""Prompt data: loaders for evaluation prompt sets (Spec-Bench, ShareGPT, plain prompts) and a built-in set."""

from selfspec.data.prompts import PromptItem, builtin_prompts, load_prompts

__all__ = ["PromptItem", "builtin_prompts", "load_prompts"]
