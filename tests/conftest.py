"""Tiny random models of the four supported architectures, built in-process (seconds, no files)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# The device the tiny models run on: cpu (default) or cuda (eval/gpu_check.sh sets SELFSPEC_TEST_DEVICE=cuda).
DEVICE = os.environ.get("SELFSPEC_TEST_DEVICE", "cpu")

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=256, eos_token_id=257, pad_token_id=258,
    # A wide init makes every layer matter, so early exits disagree with the full model often enough
    # for acceptance to be partial (with the default 0.02 the residual stream is all embedding).
    initializer_range=0.3, tie_word_embeddings=False,
)

ARCHS = {
    "llama": dict(model_type="llama"),
    # qwen2 and mistral with short sliding windows, so that masks with windows are exercised
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=12, max_window_layers=2),
    "mistral": dict(model_type="mistral", sliding_window=12),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=12, head_dim=16, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
}


def tiny_spec(arch: str, **overrides) -> dict:
    return {**COMMON, **ARCHS[arch], **overrides}


def make_tiny(arch: str = "llama", head: str | None = None, exit_layer: int | None = None, seed: int = 0, **spec):
    from selfspec.api import SelfSpecModel
    from selfspec.model.loading import ModelConfig

    cfg = ModelConfig(name=f"tiny-{arch}", random_init=tiny_spec(arch, **spec), seed=seed, device=DEVICE)
    return SelfSpecModel.from_pretrained(cfg, head=head, exit_layer=exit_layer)


def randomize_head(head, seed: int = 0, std: float = 0.2) -> None:
    """Give an untrained head non-trivial weights, so drafts differ from the plain logit lens."""
    g = torch.Generator().manual_seed(seed)
    params = head.trainable_parameters().values()
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * std)


def near_lens_context_head(m, E: int, seed: int = 3, **kw) -> None:
    """A context head near the logit lens it starts as: drafts are accepted, several in a row."""
    m.set_head("context", exit_layer=E, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.head.named_parameters():
            if "norm" not in name and "ln" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny("llama")
