"""What selfspec needs from an HF model's generation config and tokenizer (their APIs shift between versions)."""

from __future__ import annotations


def eos_token_ids(hf_model, tokenizer) -> list[int]:
    """Every id that ends a generation: the generation config's EOS (an int or a list) and the tokenizer's."""
    ids: set[int] = set()
    for src in (getattr(hf_model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Messages through the tokenizer's chat template, with the generation prompt (unless add_generation_prompt=False:
    a whole conversation that ends with an assistant turn), as token ids."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
