"""Offline self-distillation data: the target writes its own prompts and answers.

Prompts (Magpie, Xu et al. 2024): give the target only its chat template's user-turn prefix and *sample*
what follows until the end-of-turn token: an instruction model then writes a plausible user message.
Answers: the target answers those prompts (greedy by default). While it does, the full model's top-k
distribution at every answer position is recorded from the generation itself (a logits processor sees the
raw logits before any sampling warper), so soft targets cost no second forward pass.

Both steps run in left-padded batches through HF `generate`: on a CPU, one decode step of 32 sequences
costs about as much as ~4 steps of one, so batching is what makes synthesis affordable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from selfspec.errors import SelfSpecError

PLACEHOLDER = "\u2063SELFSPEC_USER_MESSAGE\u2063"


@dataclass
class Answer:
    response: list[int]  # new tokens, a final end-of-turn token included when the answer finished
    topk_ids: torch.Tensor  # (n, k) the full model's top-k token ids at each response position
    topk_logprobs: torch.Tensor  # (n, k) their log-probabilities (over the full vocabulary)


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


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids (B, T), attention mask (B, T); padding on the left so every row's next token is at the end."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


def _cut_at_stop(gen: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """New tokens up to and including the first stop token -> (tokens, finished)."""
    for i, t in enumerate(gen):
        if t in stop_ids:
            return gen[: i + 1], True
    return gen, False


class _TopKRecorder:
    """A logits processor that keeps the top-k log-probabilities of every step's raw logits (B, V).
    generate() runs custom processors before its sampling warpers, so these are the model's own."""

    def __init__(self, k: int):
        self.k = k
        self.ids: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top = scores.float().log_softmax(-1).topk(self.k, dim=-1)  # (B, k)
        self.ids.append(top.indices.cpu())
        self.logprobs.append(top.values.cpu())
        return scores


def _generation_config(max_new_tokens: int, temperature: float, top_p: float, stop_ids: list[int], pad_id: int):
    """A config built from scratch, so no default of the model's own (repetition penalty, top-k 50, ...)
    changes what the target would do."""
    from transformers import GenerationConfig

    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
        top_p=top_p if sample else None, top_k=0 if sample else None, eos_token_id=list(stop_ids),
        pad_token_id=pad_id, num_beams=1,
    )


@torch.inference_mode()
def sample_prompts(hf_model, tokenizer, n: int, max_tokens: int, temperature: float, top_p: float,
                   batch_size: int, seed: int, stop_ids: list[int], progress: bool = True,
                   systems: list[str] | None = None) -> list[str]:
    """n distinct non-empty user messages sampled from the target behind its user-turn prefix. With `systems`,
    the rows of each batch cycle through no system message and each of these (Magpie's domain steering)."""
    prefixes = [user_turn_prefix(tokenizer, s) for s in [None, *(systems or [])]]
    end_of_turn = prefixes[0][1]
    stops = sorted({*stop_ids, *([end_of_turn] if end_of_turn is not None else [])})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    gen_cfg = _generation_config(max_tokens, max(temperature, 1e-5), top_p, stops, pad)
    device = hf_model.device
    ids, mask = _left_pad([prefixes[r % len(prefixes)][0] for r in range(batch_size)], pad, device)
    seen: set[str] = set()
    prompts: list[str] = []
    max_batches = 3 * (-(-n // batch_size)) + 2  # duplicates are rare; give up rather than loop forever
    bar = tqdm(total=n, desc="sampling prompts", unit="prompt", disable=not progress)
    for b in range(max_batches):
        if len(prompts) >= n:
            break
        torch.manual_seed(seed * 1_000_003 + b)
        out = hf_model.generate(ids, attention_mask=mask, generation_config=gen_cfg)
        for row in out[:, ids.shape[1]:].tolist():
            tokens, _ = _cut_at_stop(row, set(stops))
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            if text and text not in seen and len(prompts) < n:
                seen.add(text)
                prompts.append(text)
                bar.update(1)
    bar.close()
    return prompts


@torch.inference_mode()
def answer_prompts(hf_model, prompt_ids: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                   batch_size: int, seed: int, stop_ids: list[int], pad_id: int, topk: int,
                   progress: bool = True) -> list[Answer]:
    """The target's answers to chat-encoded prompts, with its top-k distribution at every answer position."""
    gen_cfg = _generation_config(max_tokens, temperature, top_p, stop_ids, pad_id)
    stops = set(stop_ids)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # similar lengths: less padding
    answers: list[Answer | None] = [None] * len(prompt_ids)
    bar = tqdm(total=len(prompt_ids), desc="answering", unit="prompt", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = _left_pad([prompt_ids[i] for i in idx], pad_id, hf_model.device)
        rec = _TopKRecorder(topk)
        torch.manual_seed(seed * 1_000_003 + start)
        out = hf_model.generate(ids, attention_mask=mask, generation_config=gen_cfg, logits_processor=[rec])
        top_ids = torch.stack(rec.ids, 1)  # (B, steps, k)
        top_lp = torch.stack(rec.logprobs, 1)
        for r, i in enumerate(idx):
            response, _ = _cut_at_stop(out[r, ids.shape[1]:].tolist(), stops)
            n = len(response)
            answers[i] = Answer(response, top_ids[r, :n].clone(), top_lp[r, :n].clone())
        bar.update(len(idx))
    bar.close()
    return answers  # type: ignore[return-value]


@torch.inference_mode()
def score_sequences(backbone, sequences: list[tuple[list[int], list[int]]], topk: int, batch_size: int = 8,
                    progress: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Top-k of the full model at each response position of given (prompt, response) pairs, by one forward
    pass per batch (for responses the target did not write itself). -> [(ids (n, k), logprobs (n, k))]."""
    out: list = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: sum(map(len, sequences[i])))
    bar = tqdm(total=len(sequences), desc="scoring", unit="seq", disable=not progress)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        rows = [sequences[i][0] + sequences[i][1] for i in idx]
        ids = right_pad(rows, 0).to(backbone.device)
        # Right padding needs no mask: with causal attention no real position sees a later pad.
        h = backbone.run_layers(backbone.embed(ids), 0, backbone.num_layers)  # (B, T, H)
        for r, i in enumerate(idx):
            P, n = len(sequences[i][0]), len(sequences[i][1])
            logp = backbone.logits(backbone.norm(h[r, P - 1 : P - 1 + n])).float().log_softmax(-1)  # (n, V)
            top = logp.topk(topk, dim=-1)
            out[i] = (top.indices.cpu(), top.values.cpu())
        bar.update(len(idx))
    bar.close()
    return out


def right_pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return ids
