"""Reuse of early layers, the LoRA switch, the position-indexed cache, head save/load."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding.engine import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads import load_head, save_head


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("head_type", ["medusa", "adapter"])
def test_reuse_verify_logits_equal_fresh_forward(arch, head_type):
    """The verifier runs only layers >= E over drafted positions, on early-layer K/V and hidden states the
    draft wrote. Its logits must equal a fresh full forward over the same tokens."""
    m = make_tiny(arch, head=head_type, exit_layer=3)
    randomize_head(m.head, seed=1)
    seen = []
    m._decoder.generate(m.encode("Reuse check: a longer prompt"), DecodeConfig(draft_len=4, max_new_tokens=30),
                        observer=lambda ids, logits: seen.append((ids, logits.clone())))
    assert len(seen) > 3
    with torch.no_grad():
        for ids, logits in seen:
            fresh = m.hf_model(torch.tensor([ids])).logits[0, -logits.shape[0]:]
            torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)


def test_lora_off_equals_untouched_model():
    base = make_tiny("llama", seed=5)
    m = make_tiny("llama", seed=5)
    m.set_head("lora", exit_layer=3)
    randomize_head(m.head, seed=2, std=0.1)
    ids = torch.tensor([m.encode("LoRA switch")])
    with torch.no_grad():
        untouched = base.hf_model(ids).logits
        off = m.hf_model(ids).logits  # adapters are off outside drafting
        with m.head.drafting():
            on = m.hf_model(ids).logits
    assert torch.equal(off, untouched)
    assert not torch.allclose(on, untouched)
    # base weights are untouched by the injection
    for (n1, p1), (n2, p2) in zip(base.hf_model.named_parameters(), ((n, p) for n, p in m.hf_model.named_parameters() if "lora_" not in n)):
        assert torch.equal(p1, p2), n1


def test_draft_vocab_only_scores_subset(tiny_llama):
    m = tiny_llama
    m.set_head("medusa", exit_layer=2, draft_vocab=50)
    assert m.head.vocab_ids.numel() == 50 and 257 in m.head.vocab_ids.tolist()  # EOS always kept
    h = torch.randn(1, 3, m.backbone.hidden_size)
    assert m.head(h, m.backbone).shape == (1, 3, 50)


@pytest.mark.parametrize("head_type", ["medusa", "adapter", "lora"])
def test_head_save_load_roundtrip(tmp_path, head_type):
    m = make_tiny("llama")
    m.set_head(head_type, exit_layer=2, draft_vocab=100)
    randomize_head(m.head, seed=4, std=0.05)
    ids = m.encode("Roundtrip")
    before = m.generate(ids, max_new_tokens=20, draft_len=3)
    path = save_head(m.head, tmp_path / "head", m.backbone)
    cfg = json.loads((path / "head_config.json").read_text())
    assert cfg["type"] == head_type and cfg["exit_layer"] == 2 and cfg["base_model"]["num_layers"] == 6
    m2 = make_tiny("llama")
    m2.set_head(str(path))
    after = m2.generate(ids, max_new_tokens=20, draft_len=3)
    assert after.token_ids == before.token_ids and after.stats["accepted"] == before.stats["accepted"]
    assert m2.head.vocab_ids.tolist() == m.head.vocab_ids.tolist()


def test_head_errors(tmp_path, tiny_llama):
    m = tiny_llama
    m.set_head("medusa", exit_layer=2)
    path = save_head(m.head, tmp_path / "h", m.backbone)
    other = make_tiny("llama", seed=9)  # same sizes, other weights
    with pytest.raises(SelfSpecError, match="saved for another model"):
        load_head(path, other.backbone)
    bigger = make_tiny("llama", hidden_size=96)
    with pytest.raises(SelfSpecError, match="saved for another model"):
        load_head(path, bigger.backbone)
    with pytest.raises(SelfSpecError, match="directory not found"):
        load_head(tmp_path / "missing", m.backbone)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SelfSpecError, match="not a head directory"):
        load_head(tmp_path / "empty", m.backbone)
    bad = save_head(m.head, tmp_path / "bad_json", m.backbone)
    (bad / "head_config.json").write_text("{not json")
    with pytest.raises(SelfSpecError, match="corrupt head_config.json"):
        load_head(bad, m.backbone)
    bad = save_head(m.head, tmp_path / "bad_weights", m.backbone)
    (bad / "head.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(SelfSpecError, match="corrupt head.safetensors"):
        load_head(bad, m.backbone)


def test_untrained_medusa_is_the_lens(tiny_llama):
    """Zero-initialised ResBlocks: an untrained medusa head drafts exactly what the logit lens drafts."""
    m = tiny_llama
    h = torch.randn(1, 5, m.backbone.hidden_size)
    with torch.inference_mode():  # as the engine drafts (outside it, autograd would route the LM head to torch)
        m.set_head("lens", exit_layer=3)
        lens = m.head(h, m.backbone)
        m.set_head("medusa", exit_layer=3, num_blocks=2)
        assert torch.equal(m.head(h, m.backbone), lens)
    ids = m.encode("same drafts")
    a = m.generate(ids, max_new_tokens=16, draft_len=3)
    m.set_head("lens", exit_layer=3)
    b = m.generate(ids, max_new_tokens=16, draft_len=3)
    assert a.token_ids == b.token_ids and a.stats["accepted_per_position"] == b.stats["accepted_per_position"]


def test_draft_steps_count_declined_drafts():
    """With dynamic K the head runs once per draft attempt; attempts it declines are counted in draft_steps
    (the cost model's c is per exit-head pass) but not in drafted."""
    m = make_tiny("llama", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=3)
    ids = [5, 17, 42, 99, 7, 3]
    fixed = m.generate(ids, max_new_tokens=24, decode=DecodeConfig(draft_len=3, max_new_tokens=24)).stats
    assert fixed["draft_steps"] == fixed["drafted"] > 0
    dyn = m.generate(ids, max_new_tokens=24, decode=DecodeConfig(draft_len=3, draft_threshold=0.99, max_new_tokens=24)).stats
    assert dyn["draft_steps"] >= dyn["verify_steps"] - 1 > dyn["drafted"]
