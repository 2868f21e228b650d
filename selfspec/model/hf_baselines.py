"""HF's own decoding on the target model, as baselines: `generate`, HF's early-exit assistant and prompt
lookup, all greedy, with the target's forward passes counted so that they report tau and acceptance like
our engine does.

This module and backbone.py are where HF internals live (`config.num_hidden_layers`, the cache argument of a
forward call, `generate`'s keyword arguments). HF `generate` on the model object never uses selfspec's CPU
kernels, so the baselines stay HF's own.
"""

from __future__ import annotations

import time

import torch

from selfspec.utils.timing import sync


def early_exit_kwargs(exit_layer: int, num_assistant_tokens: int | None = None) -> dict:
    """`generate` arguments for HF's early-exit assistant: the model itself, cut to `exit_layer` layers, drafts
    (no KV sharing between draft and target); num_assistant_tokens=None keeps HF's schedule."""
    kw: dict = {"assistant_early_exit": int(exit_layer)}
    if num_assistant_tokens:
        kw["num_assistant_tokens"] = int(num_assistant_tokens)
    return kw


def prompt_lookup_kwargs(num_tokens: int = 10, max_matching_ngram_size: int | None = None) -> dict:
    """`generate` arguments for HF's prompt lookup: drafts copied from n-gram matches in the context."""
    kw: dict = {"prompt_lookup_num_tokens": int(num_tokens)}
    if max_matching_ngram_size:
        kw["max_matching_ngram_size"] = int(max_matching_ngram_size)
    return kw


class TargetCalls:
    """Forward pre-hook on the HF model that records (first position, number of tokens) of each full-depth call.

    HF's early-exit assistant is the model itself with `config.num_hidden_layers` lowered to E while it
    drafts; those calls are drafts and are skipped. What remains are the target's forward passes: prefill,
    then one per generated token (plain generate) or one per verify round (assisted generation)."""

    def __init__(self, hf_model):
        self.model = hf_model
        self.depth = hf_model.config.num_hidden_layers
        self.calls: list[tuple[int, int]] = []

    def __enter__(self):
        self.calls = []
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()

    def _hook(self, module, args, kwargs):
        if self.model.config.num_hidden_layers < self.depth:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("position_ids")
        if pos is not None:
            start = int(pos[0, 0])
        else:  # the uncached part starts where the cache ends
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            start = cache.get_seq_length() if cache is not None else 0
        self.calls.append((start, int(ids.shape[1])))


def hf_round_stats(calls: list[tuple[int, int]], prompt_len: int, new_tokens: int) -> dict:
    """Drafted / accepted counts per round, recovered from the target's calls.

    A round starts at the last committed token, which the target has not yet seen (position start); its input
    holds that token and the k drafts, so with c committed tokens k = start + n - c. The next round starts at
    the new last committed token: c' = start' + 1, and the round accepted a = c' - c - 1 drafts."""
    drafted_pp: list[int] = []
    accepted_pp: list[int] = []
    committed = prompt_len
    for i, (start, n) in enumerate(calls):
        k = max(0, start + n - committed)
        nxt = calls[i + 1][0] + 1 if i + 1 < len(calls) else prompt_len + new_tokens
        a = max(0, min(k, nxt - committed - 1))
        for j in range(k):
            if j == len(drafted_pp):
                drafted_pp.append(0)
                accepted_pp.append(0)
            drafted_pp[j] += 1
            accepted_pp[j] += int(j < a)
        committed = nxt
    return {"verify_steps": len(calls), "drafted": sum(drafted_pp), "accepted": sum(accepted_pp),
            "drafted_per_position": drafted_pp, "accepted_per_position": accepted_pp}


class HFGenerate:
    """Greedy HF `generate` on the target: `generate(ids, max_new_tokens) -> (new ids, stats)`.

    Stats: new_tokens, seconds (the whole `generate` call), prompt_tokens, verify_steps (the target's forward
    passes), drafted, accepted and the per-position counts (zero drafts for plain `generate`)."""

    def __init__(self, hf_model, tokenizer, eos_ids: list[int], generate_kwargs: dict | None = None):
        self.hf_model = hf_model
        self.kwargs = dict(generate_kwargs or {})
        self.eos_ids = list(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        dev = self.hf_model.device
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        with TargetCalls(self.hf_model) as calls:
            t = time.perf_counter()
            # EOS ids and pad given explicitly: HF then stops exactly where our engine stops (EOS included).
            out = self.hf_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=self.eos_ids, pad_token_id=self.pad_id, **self.kwargs,
            )
            sync(dev)
            seconds = time.perf_counter() - t
        new = out[0, len(ids):].tolist()
        # Batch 1 never pads, but a stray pad after EOS would break the token-for-token comparison.
        for i, tok in enumerate(new):
            if tok in self.eos_ids:
                new = new[: i + 1]
                break
        stats = {"new_tokens": len(new), "seconds": seconds, "prompt_tokens": len(ids),
                 **hf_round_stats(calls.calls, len(ids), len(new))}
        return new, stats


# ------------------------------------------------------------------------------------------------ generate with top-k
def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ids (B, T), attention mask (B, T); padding on the left so every row's next token is at the end."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids.to(device), mask.to(device)


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


@torch.inference_mode()
def generate_with_topk(hf_model, prompt_ids: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                       batch_size: int, seed: int, stop_ids: list[int], pad_id: int, topk: int,
                       cache_implementation: str | None = None) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """HF `generate` on prompts (token ids) in left-padded batches of `batch_size` (sorted by length), each running
    until its longest row stops, with the top-k log-probabilities of every step's raw logits recorded (synthesis's
    reference path: training/synthesis.py answer_prompts_hf). -> per prompt, in order: (the generated ids, past
    any stop token up to the batch's last step; top-k ids (steps, k); their log-probabilities (steps, k))."""
    from transformers import GenerationConfig

    sample = temperature > 0
    gen_cfg = GenerationConfig(  # from scratch: no default of the model's own (repetition penalty, top-k 50)
        max_new_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else None,
        top_p=top_p if sample else None, top_k=0 if sample else None, eos_token_id=list(stop_ids),
        pad_token_id=pad_id, num_beams=1, cache_implementation=cache_implementation,
    )
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list = [None] * len(prompt_ids)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = _left_pad([prompt_ids[i] for i in idx], pad_id, hf_model.device)
        rec = _TopKRecorder(topk)
        torch.manual_seed(seed * 1_000_003 + start)
        gen = hf_model.generate(ids, attention_mask=mask, generation_config=gen_cfg, logits_processor=[rec])
        top_ids, top_lp = torch.stack(rec.ids, 1), torch.stack(rec.logprobs, 1)  # (B, steps, k)
        for r, i in enumerate(idx):
            out[i] = (gen[r, ids.shape[1]:].tolist(), top_ids[r], top_lp[r])
    return out
