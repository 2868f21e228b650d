"""Heads: the LoRA switch, the draft vocabulary, typed per-head configs, save/load (today's and the old flat
format), and the errors a bad head file or config gets."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.cli.config import head_config
from selfspec.errors import SelfSpecError
from selfspec.heads import (
    AdapterConfig, HeadConfig, LoraHeadConfig, MedusaConfig, build_head, head_types, load_head, make_head_config, save_head,
)


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
    assert type(m2.head.config) is type(m.head.config) and m2.head.config == m.head.config


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


# ------------------------------------------------------------------------------------------------ configs
def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("generate", overrides=list(overrides))


def test_head_configs_are_typed_per_head():
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir

    assert set(head_types()) >= {"lens", "medusa", "adapter", "lora"}
    cfg = head_config(_compose("head=medusa", "head.num_blocks=2", "head.exit_layer=3").head)
    assert type(cfg) is MedusaConfig and (cfg.num_blocks, cfg.exit_layer) == (2, 3)
    assert type(head_config(_compose().head)) is HeadConfig  # the lens has only the common keys
    lora = head_config(_compose("head=lora", "head.lora_targets=q_proj").head)
    assert type(lora) is LoraHeadConfig and lora.lora_targets == ["q_proj"]  # a single name is a one-name list
    assert make_head_config("medusa", num_heads=2) == MedusaConfig(num_heads=2)
    # an experiment's sizes for medusa under another head type are not that head's: dropped, as they always were
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        train = compose("train", overrides=["experiment=default", "head=adapter"])
    assert head_config(train.head) == AdapterConfig(exit_layer=6, draft_vocab=8192)
    with pytest.raises(SelfSpecError, match=r"head: unknown key\(s\) num_block for head type 'medusa'"):
        head_config({"type": "medusa", "num_block": 2})  # a key no head type has: a typo
    with pytest.raises(SelfSpecError, match=r"head: unknown key\(s\) num_blocks for head type 'lens'; allowed: allow_other_model, (draft_precision, )?draft_vocab, exit_layer, path, type"):
        make_head_config("lens", num_blocks=2)
    with pytest.raises(SelfSpecError, match=r"head.type='nope': allowed adapter, (.*, )?lens, lora, (.*, )?medusa"):
        make_head_config("nope")


@pytest.mark.parametrize(
    "type_, values, message",
    [
        ("medusa", dict(num_blocks=None), r"head.num_blocks=None: must be an integer >= 0"),
        ("medusa", dict(num_heads=0), r"head.num_heads=0: must be an integer >= 1"),
        ("medusa", dict(draft_vocab="64"), r"head.draft_vocab='64': must be an integer >= 1"),
        ("lens", dict(exit_layer="3"), r"head.exit_layer='3': must be an integer"),
        ("adapter", dict(adapter_heads=1.5), r"head.adapter_heads=1.5: must be an integer >= 1 \(or null\)"),
        ("lora", dict(lora_rank=True), r"head.lora_rank=True: must be an integer >= 1"),
        ("lora", dict(lora_targets=[]), r"head.lora_targets=\[\]: must be a non-empty list"),
        ("lora", dict(lora_alpha="x"), r"head.lora_alpha='x': must be a number > 0"),
    ],
)
def test_bad_head_config_values(type_, values, message):
    with pytest.raises(SelfSpecError, match=message):
        make_head_config(type_, **values)


def test_old_flat_head_file_loads(tmp_path, tiny_llama):
    """Heads saved before the per-type configs stored every type's fields in one flat JSON."""
    m = tiny_llama
    m.set_head("medusa", exit_layer=2, num_blocks=2)
    randomize_head(m.head, seed=1)
    path = save_head(m.head, tmp_path / "old", m.backbone)
    data = json.loads((path / "head_config.json").read_text())
    data.update(num_heads=1, adapter_heads=None, lora_rank=8, lora_alpha=16.0, lora_targets=["q_proj"], draft_vocab=None)
    (path / "head_config.json").write_text(json.dumps(data))
    head = load_head(path, m.backbone)
    assert type(head.config) is MedusaConfig and head.config.num_blocks == 2
    assert all(torch.equal(a, b) for a, b in zip(head.parameters(), m.head.parameters()))
    data["num_blocks"] = None  # a bad value in the file: one line naming the file and the key
    (path / "head_config.json").write_text(json.dumps(data))
    with pytest.raises(SelfSpecError, match=r"head.path='.*old': bad head_config.json: head.num_blocks=None"):
        load_head(path, m.backbone)


@pytest.mark.parametrize("bad_id", [320, -1])
def test_draft_vocab_ids_are_checked_on_load(tmp_path, tiny_llama, bad_id):
    """Out of range ids used to fail at the first draft (IndexError), negative ones to wrap silently."""
    from safetensors.torch import load_file, save_file

    m = tiny_llama
    m.set_head("medusa", exit_layer=2, draft_vocab=20)
    path = save_head(m.head, tmp_path / "h", m.backbone)
    tensors = load_file(str(path / "head.safetensors"))
    tensors["vocab_ids"][3] = bad_id
    save_file(tensors, str(path / "head.safetensors"))
    with pytest.raises(SelfSpecError, match=rf"draft vocabulary ids must be in \[0, 320\); found {bad_id}"):
        load_head(path, m.backbone)
    tensors["vocab_ids"][3] = tensors["vocab_ids"][4]
    save_file(tensors, str(path / "head.safetensors"))
    with pytest.raises(SelfSpecError, match="must be distinct"):
        load_head(path, m.backbone)


def test_no_head_class_dispatch_outside_heads():
    """Training, evaluation and saving ask the head (its methods and attributes), never its class."""
    import re
    from pathlib import Path

    import selfspec

    root = Path(selfspec.__file__).parent
    pattern = re.compile(r"\b(LoraHead|AdapterHead|MedusaHead|LensHead)\b")  # ExitHead (any head) is fine
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if "heads" not in p.parts
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_build_head_from_a_plain_head_config(tiny_llama):
    """HeadConfig(type=...) (the common keys only) builds that type with its defaults."""
    head = build_head(HeadConfig(type="medusa", exit_layer=2), tiny_llama.backbone)
    assert type(head.config) is MedusaConfig and head.config.num_blocks == 1 and head.exit_layer == 2
