"""model.off_grid: a native-like testbed, the weights nudged off the 4-bit grid of a de-quantized GGUF (loading.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_spec
from selfspec.api import SelfSpecModel
from selfspec.errors import SelfSpecError
from selfspec.model.loading import ModelConfig, nudge_off_grid
from selfspec.model.quant import quantize


def _cfg(off_grid: float = 0.0) -> ModelConfig:
    return ModelConfig(name="tiny-llama", random_init=tiny_spec("llama"), off_grid=off_grid)


def _on_grid(w: torch.Tensor) -> torch.Tensor:
    """w's 4-bit version in blocks of 32 (plain min/max rounding): a weight on that grid is its own rounding."""
    blocks = w.view(w.shape[0], -1, 32)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    return (torch.round((blocks - lo) / step) * step + lo).view_as(w)


def test_the_nudge_moves_every_weight_off_its_grid_by_at_most_the_asked_share_of_a_step():
    g = torch.Generator().manual_seed(0)
    w = _on_grid(torch.randn(16, 64, generator=g))
    model = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        model.weight.copy_(w)
    nudge_off_grid(model, 0.5, seed=3)
    moved = model.weight.detach() - w
    step = ((w.view(16, -1, 32).amax(-1) - w.view(16, -1, 32).amin(-1)) / 15)[..., None]
    assert (moved.view(16, -1, 32).abs() <= 0.5 * step + 1e-6).all() and (moved != 0).float().mean() > 0.99
    again = torch.nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        again.weight.copy_(w)
    nudge_off_grid(again, 0.5, seed=3)
    assert torch.equal(again.weight, model.weight)  # seeded: the same testbed every time
    # int4 in groups of 32 lands on the grid again as loaded, no longer once nudged
    assert torch.allclose(quantize(w, "int4").dequantize(), w, atol=1e-5)
    assert not torch.allclose(quantize(model.weight.detach(), "int4").dequantize(), model.weight.detach(), atol=1e-3)


def test_an_off_grid_model_is_another_model_for_caches_and_heads(tmp_path: Path):
    plain, nudged = SelfSpecModel.from_pretrained(_cfg(), head=None), SelfSpecModel.from_pretrained(_cfg(0.5), head=None)
    assert _cfg(0.5).cache_name == "tiny-llama-offgrid0.5" and _cfg().cache_name == "tiny-llama"
    a = dict(plain.hf_model.named_parameters())
    b = dict(nudged.hf_model.named_parameters())
    assert not torch.equal(a["model.layers.0.mlp.down_proj.weight"], b["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(a["model.norm.weight"], b["model.norm.weight"])  # 1-D weights stay as they are
    assert plain.backbone.fingerprint()["tensor_probe"] != nudged.backbone.fingerprint()["tensor_probe"]
    # a head saved on the off-grid copy records it, and loads on it again
    nudged.set_head("lowbit", exit_layer=2, lora_rank=2)
    nudged.head.save_pretrained(tmp_path / "h")
    import json

    saved = json.loads((tmp_path / "h" / "head_config.json").read_text())
    assert saved["base_model_off_grid"] == 0.5
    assert SelfSpecModel.from_pretrained(_cfg(0.5), head=str(tmp_path / "h")).head.base_model_check["verdict"] == "same"


@pytest.mark.parametrize("bad", [-0.1, 1.5, "x", True])
def test_bad_off_grid_is_one_line(bad):
    with pytest.raises(SelfSpecError, match=r"model.off_grid=.*: must be a number in \[0, 1\]"):
        _cfg(bad)
