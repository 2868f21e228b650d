"""selfspec.training.validation: heads decode against our autoregressive path (and HF generate), interleaved."""

from __future__ import annotations

import subprocess
import sys

from conftest import make_tiny
from selfspec.decoding.engine import DecodeConfig
from selfspec.heads import HeadConfig, build_head
from selfspec.model.hf_baselines import HFGenerate
from selfspec.training.validation import validate


def test_validate_with_reference() -> None:
    m = make_tiny("llama")
    bb = m.backbone
    heads = {f"lens{E}": build_head(HeadConfig(type="lens", exit_layer=E), bb) for E in (2, 4)}
    heads["lens4"].train()
    heads["lens2"].eval()
    prompts = [m.encode(p, chat=False) for p in ("hello there", "the sky is", "one two three")]
    ref = HFGenerate(m.hf_model, m.tokenizer, m.eos_ids)
    out = validate(bb, heads, prompts, DecodeConfig(draft_len=3, max_new_tokens=8), m.eos_ids, reference=ref)
    assert set(out) == {"lens2", "lens4", "autoregressive"}
    for name in heads:
        r = out[name]
        assert r["val/lossless"] == 1.0 and r["val/tau"] >= 1.0 and 0 <= r["val/accept_rate"] <= 1
        assert len(r["val/accept_rate_per_position"]) == 3 and r["val/new_tokens"] > 0
        assert r["val/speedup"] > 0 and r["val/speedup_hf"] > 0
        assert r["val/ar_tokens_per_s"] == out["autoregressive"]["val/tokens_per_s"]
    assert out["autoregressive"]["val/lossless"] == 1.0 and out["autoregressive"]["val/speedup_hf"] > 0
    assert heads["lens4"].training and not heads["lens2"].training  # modes put back
    # without a reference: no HF numbers
    plain = validate(bb, heads, prompts[:1], DecodeConfig(draft_len=2, max_new_tokens=6), m.eos_ids)
    assert set(plain) == {"lens2", "lens4"} and "val/speedup_hf" not in plain["lens2"]


def test_training_does_not_import_evaluation() -> None:
    code = ("import sys, selfspec.cli.train, selfspec.training, selfspec.training.run, selfspec.training.validation;"
            "bad = [m for m in sys.modules if m.startswith('selfspec.evaluation')]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
