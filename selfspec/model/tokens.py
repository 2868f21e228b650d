"""What selfspec needs from an HF model's generation config and tokenizer (their APIs shift between versions)."""

from __future__ import annotations

from selfspec.errors import SelfSpecError

PLACEHOLDER = "\u2063SELFSPEC_USER_MESSAGE\u2063"


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


def user_turn_prefix(tokenizer, system: str | None = None) -> tuple[list[int], int | None]:
    """Ids of the chat template up to where a user's message starts, and the token that ends the turn.

    A conversation with a placeholder user message (after `system`, when given) is rendered and cut at the
    placeholder; the first token after it (e.g. `<|im_end|>`) is the end-of-turn token.
    -> (prefix ids, end-of-turn id or None)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SelfSpecError("data=selfgen needs a model with a chat template (this one has none); use data=jsonl data.path=FILE")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": PLACEHOLDER})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if PLACEHOLDER not in text:
        raise SelfSpecError("data=selfgen: the chat template drops the user message; use data=jsonl data.path=FILE")
    before, after = text.split(PLACEHOLDER, 1)
    prefix = tokenizer(before, add_special_tokens=False)["input_ids"]
    suffix = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    return list(prefix), (suffix[0] if suffix else None)


def text_streamer(tokenizer):
    """transformers' TextStreamer on this tokenizer: prints the new text as it is committed (no prompt, no special
    tokens)."""
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def generation_defaults() -> dict:
    """What transformers' GenerationConfig applies to a key left unset ({} on versions without that hook)."""
    from transformers import GenerationConfig

    return getattr(GenerationConfig, "_get_default_generation_params", dict)()
