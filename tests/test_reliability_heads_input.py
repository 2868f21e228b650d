"""Issue 58, third round: heads that do not survive their export or load (non-finite or out-of-range weights, stray
int8 scales), heads of two models averaged, and the small input holes (a shipped head's name for export_head, a
64-bit overflowing seed, temperature=inf, chat messages without a role, numpy prompts). Each is one line naming the
parameter, and nothing is written."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny, randomize_head
from selfspec.cli.export_head import main as export_main
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.heads import load_head, save_head
from selfspec.heads.export import export_head
from selfspec.heads.saving import CONFIG_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def medusa():
    """A tiny llama with a randomized medusa head at layer 2 (matrices and vectors, so int8 stores both kinds)."""
    m = make_tiny("llama", head="medusa", exit_layer=2)
    randomize_head(m.head, seed=5, std=0.05)
    return m


def _saved(m, path):
    return save_head(m.head, path, m.backbone)


def _rewrite(path, change) -> dict:
    """head.safetensors read, changed in place by `change(tensors)`, written back (what a damaged or crafted file
    holds; save_head itself refuses non-finite weights)."""
    tensors = load_file(str(path / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))
    return tensors


def _one_line_cli_error(capsys, args, match):
    capsys.readouterr()
    assert export_main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


def _matrix_and_vector(tensors):
    floats = {k: v for k, v in tensors.items() if v.is_floating_point()}
    return (next(k for k, v in floats.items() if v.dim() == 2), next(k for k, v in floats.items() if v.dim() == 1))


# ---------------------------------------------------------------------------------------------- 4. non-finite heads
def test_float16_export_refuses_weights_beyond_its_range_and_writes_nothing(tmp_path, medusa, capsys):
    src = _saved(medusa, tmp_path / "src")
    mat, vec = _matrix_and_vector(load_file(str(src / WEIGHTS_FILE)))
    _rewrite(src, lambda t: t[mat].view(-1).__setitem__(3, -1e6))  # finite in float32, inf in float16
    with pytest.raises(SelfSpecError, match=rf"^--dtype=float16: {mat} has max \|value\| 1e\+06, beyond float16's "
                                            r"range \(65504\).*not exported"):
        export_head(src, tmp_path / "f16", "float16")
    assert not (tmp_path / "f16").exists()
    _one_line_cli_error(capsys, [src, tmp_path / "f16"], f"{mat} has max |value| 1e+06")
    assert not (tmp_path / "f16").exists()
    # float32 keeps it (no cast); int8 scales the matrix per row, so only a vector (kept in float16) can overflow
    assert load_file(str(export_head(src, tmp_path / "f32", "float32") / WEIGHTS_FILE))[mat].abs().max() == 1e6
    _rewrite(src, lambda t: t[vec].__setitem__(0, 7e4))
    with pytest.raises(SelfSpecError, match=rf"^--dtype=int8: {vec} has max \|value\| 70000, beyond float16's range"):
        export_head(src, tmp_path / "q8", "int8")
    assert not (tmp_path / "q8").exists()


def test_export_refuses_non_finite_weights_in_src_or_other(tmp_path, medusa):
    src, other = _saved(medusa, tmp_path / "src"), _saved(medusa, tmp_path / "other")
    mat, _ = _matrix_and_vector(load_file(str(src / WEIGHTS_FILE)))
    _rewrite(src, lambda t: t[mat].view(-1).__setitem__(0, float("nan")))
    with pytest.raises(SelfSpecError, match=rf"^SRC='.*src': head.safetensors: {mat} holds NaN or inf; not exported"):
        export_head(src, tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()
    clean = _saved(medusa, tmp_path / "clean")
    _rewrite(other, lambda t: t[mat].view(-1).__setitem__(0, float("inf")))
    with pytest.raises(SelfSpecError, match=rf"^--average='.*other': head.safetensors: {mat} holds NaN or inf"):
        export_head(clean, tmp_path / "avg", "float32", average=other)
    assert not (tmp_path / "avg").exists()


def test_load_head_refuses_non_finite_weights_before_sampling_trips_on_them(tmp_path, medusa):
    path = _saved(medusa, tmp_path / "h")
    mat, vec = _matrix_and_vector(load_file(str(path / WEIGHTS_FILE)))
    _rewrite(path, lambda t: t[vec].__setitem__(1, float("inf")))
    with pytest.raises(SelfSpecError, match=rf"^head.path='.*h': head.safetensors: {vec} holds NaN or inf$"):
        load_head(path, medusa.backbone)
    m = make_tiny("llama")  # before: the head loaded, and sampling failed inside torch.multinomial
    with pytest.raises(SelfSpecError, match=rf"head.safetensors: {vec} holds NaN or inf"):
        m.set_head(str(path))
    assert m.head is None
    # an int8 file: a NaN scale makes its matrix NaN once dequantized
    q8 = export_head(_saved(medusa, tmp_path / "clean"), tmp_path / "q8", "int8")
    _rewrite(q8, lambda t: t[mat + ".int8_scale"].__setitem__(0, float("nan")))
    with pytest.raises(SelfSpecError, match=rf"head.safetensors: {mat} holds NaN or inf"):
        load_head(q8, medusa.backbone)


# ------------------------------------------------------------------------------------ 5. averaging heads of two models
def _like_a_4bit_quantization(m) -> None:
    """Every weight matrix through a 16-level per-block round trip, norms untouched: the same model from another
    quantization, as identity.py tells them apart."""
    with torch.no_grad():
        for p in m.hf_model.parameters():
            if p.dim() >= 2:
                rows = p.reshape(-1, 64)
                lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
                step = (hi - lo) / 15
                p.copy_((lo + ((rows - lo) / step).round() * step).reshape(p.shape))


def test_heads_of_two_different_models_do_not_average(tmp_path, medusa, capsys):
    a = _saved(medusa, tmp_path / "a")
    other_model = make_tiny("llama", head="medusa", exit_layer=2, seed=11)  # same architecture, other weights
    randomize_head(other_model.head, seed=6, std=0.05)
    b = _saved(other_model, tmp_path / "b")
    config_a, config_b = (json.loads((p / CONFIG_FILE).read_text())["base_model"] for p in (a, b))
    assert config_a["tensors"] == config_b["tensors"]  # the names and shapes alone cannot tell them apart
    with pytest.raises(SelfSpecError, match=r"^--average='.*b': saved for another base model than SRC \(weights "
                                            r"further apart than another quantization"):
        export_head(a, tmp_path / "avg", "float32", average=b)
    assert not (tmp_path / "avg").exists()
    _one_line_cli_error(capsys, [a, tmp_path / "avg", "--average", b], "saved for another base model than SRC")
    assert not (tmp_path / "avg").exists()
    # the same model in another quantization is the same base model: its heads still average
    quantized = make_tiny("llama", head="medusa", exit_layer=2)
    _like_a_4bit_quantization(quantized)
    randomize_head(quantized.head, seed=7, std=0.05)
    out = export_head(a, tmp_path / "avg", "float32", average=_saved(quantized, tmp_path / "q"))
    assert load_head(out, medusa.backbone).base_model_check["verdict"] == "same"


# ------------------------------------------------------------------------------------------------------ 8. small ones
def test_export_head_takes_a_shipped_heads_name_as_head_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no directory of that name here: the name is the shipped head's
    assert export_main(["smollm2_135m", "lens", "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "lens" / CONFIG_FILE).read_text())["type"] == "lens"
    # the int8-stored context head: the usual message for it (not "corrupt head.safetensors (No such file...)")
    _one_line_cli_error(capsys, ["smollm2_135m+context", "ctx"], "already stored in int8")
    assert not (tmp_path / "ctx").exists()
    assert export_main(["smollm2_135m+context", "ctx", "--dtype", "int8", "--draft-vocab", "4096"]) == 0
    saved = json.loads((tmp_path / "ctx" / CONFIG_FILE).read_text())
    assert saved["draft_vocab"] == 4096 and load_file(str(tmp_path / "ctx" / WEIGHTS_FILE))["vocab_ids"].numel() == 4096


def test_a_seed_beyond_64_bits_is_one_line_everywhere(medusa):
    for seed in (2**70, 2**64, -1):
        with pytest.raises(SelfSpecError, match=rf"^decode.seed={seed}: must be an integer or null \(an integer in "
                                                r"\[0, 2\*\*64 - 1\]\)"):
            DecodeConfig(seed=seed, temperature=1.0)
        with pytest.raises(SelfSpecError, match=rf"^decode.seed={seed}: must be an integer"):
            DecodeConfig(temperature=1.0).for_call(seed=seed)
        with pytest.raises(SelfSpecError, match=rf"^decode.seed={seed}: must be an integer"):
            medusa.generate([5, 6, 7], max_new_tokens=3, seed=seed, temperature=1.0)
    top = medusa.generate([5, 6, 7], max_new_tokens=3, seed=2**64 - 1, temperature=1.0)  # the largest seed works
    assert top.decode.seed == 2**64 - 1 and len(top.token_ids) == 3


def test_temperature_must_be_finite(medusa):
    for bad in (float("inf"), float("nan")):
        with pytest.raises(SelfSpecError, match=r"^decode.temperature=(inf|nan): must be >= 0 and finite"):
            DecodeConfig(temperature=bad)
        with pytest.raises(SelfSpecError, match=r"^decode.temperature=(inf|nan): must be >= 0 and finite"):
            medusa.generate([5, 6, 7], max_new_tokens=3, temperature=bad)
    assert DecodeConfig(temperature=10**6).temperature == 10**6  # large but finite is a choice, not an error


def test_chat_messages_need_a_role_and_content(medusa):
    cases = [([{"content": "hi"}], r"^messages\[0\]: missing 'role'"),
             ([{"role": "user", "content": "a"}, {"content": "b"}], r"^messages\[1\]: missing 'role'"),
             ([{"role": "user"}], r"^messages\[0\]: missing 'content'"),
             ([{"role": None, "content": "a"}], r"^messages\[0\]: 'role' must be a non-empty string, not None"),
             ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
              r"^messages\[1\]: 'content' must not be empty")]
    for messages, match in cases:
        with pytest.raises(SelfSpecError, match=match):
            medusa.generate(messages, max_new_tokens=2)
    assert len(medusa.generate([{"role": "user", "content": "hi"}], max_new_tokens=2).token_ids) == 2


def test_numpy_integer_arrays_are_prompts_like_lists_of_ids(medusa):
    ids = [5, 17, 42, 9]
    want = medusa.generate(ids, max_new_tokens=5).token_ids
    for arr in (np.array(ids), np.array([ids], dtype=np.int32), np.array(ids, dtype=np.uint16)):
        assert medusa.generate(arr, max_new_tokens=5).token_ids == want, arr.dtype
    both = medusa.generate([np.array(ids), np.array(ids[:2])], max_new_tokens=5)  # a list of arrays: several prompts
    assert [r.token_ids for r in both][0] == want and len(both) == 2
    for arr, match in ((np.array(ids, dtype=np.float32), "a numpy array of token ids must have an integer dtype, not float32"),
                       (np.array([True, False]), "a numpy array of token ids must have an integer dtype, not bool"),
                       (np.array([ids, ids]), r"a numpy array of shape \(2, 4\) holds several prompts")):
        with pytest.raises(SelfSpecError, match=rf"^prompt: {match}"):
            medusa.generate(arr, max_new_tokens=2)


def test_int8_scales_go_through_the_header_check(tmp_path, medusa, monkeypatch):
    """A NAME.int8_scale must be the float [rows] scale of an int8 matrix NAME: refused from the header, before the
    file's tensors are read (a stray scale could be any size)."""
    import safetensors.torch

    src = _saved(medusa, tmp_path / "src")
    mat, vec = _matrix_and_vector(load_file(str(src / WEIGHTS_FILE)))
    rows = load_file(str(src / WEIGHTS_FILE))[mat].shape[0]
    cases = {"stray": (lambda t: t.__setitem__("nothing.int8_scale", torch.ones(4)),
                       r"nothing.int8_scale is not the scale of an int8 matrix \(nothing: missing\)"),
             "vector": (lambda t: t.__setitem__(vec + ".int8_scale", torch.ones(4)),
                        rf"{vec}.int8_scale is not the scale of an int8 matrix \({vec}: F16 \["),
             "shape": (lambda t: t.__setitem__(mat + ".int8_scale", torch.ones(rows + 1)),
                       rf"{mat}.int8_scale is F32 \[{rows + 1}\]; the scale of int8 {mat} \[{rows}, \d+\] must be "
                       rf"float \[{rows}\]"),
             "dtype": (lambda t: t.__setitem__(mat + ".int8_scale", torch.ones(rows, dtype=torch.int32)),
                       rf"{mat}.int8_scale is I32 \[{rows}\]")}
    for name, (change, match) in cases.items():
        path = export_head(src, tmp_path / name, "int8")
        _rewrite(path, change)
        with monkeypatch.context() as patch:
            patch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("read before the header check"))
            with pytest.raises(SelfSpecError, match=rf"^head.path='.*{name}': head.safetensors: {match}"):
                load_head(path, medusa.backbone)
    assert load_head(export_head(src, tmp_path / "fine", "int8"), medusa.backbone).base_model_check["verdict"] == "same"
