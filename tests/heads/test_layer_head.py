"""The full decoder-layer head (head=layer): initialised from the model's own layer E it computes exactly layer E."""

from __future__ import annotations

import pytest
import torch

from conftest import make_tiny
from selfspec.errors import SelfSpecError


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_init_from_layer_equals_that_layer(arch):
    m = make_tiny(arch)
    bb, E = m.backbone, 1  # qwen2's tiny config slides its window from layer 2 on; this head attends fully
    m.set_head("layer", exit_layer=E, init_from=E)
    ids = torch.tensor([m.encode("The quick brown fox jumps")])
    with torch.no_grad():
        h_e = bb.run_layers(bb.embed(ids), 0, E)
        want = bb.run_layers(h_e, E, E + 1)  # the model's own layer E
        got = m.head.transform(h_e, bb)  # no cache: causal over the chunk
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_zero_init_is_the_lens():
    m = make_tiny("llama")
    bb = m.backbone
    m.set_head("layer", exit_layer=3)
    ids = torch.tensor([m.encode("Once upon a time")])
    with torch.no_grad():
        h = bb.run_layers(bb.embed(ids), 0, 3)
        torch.testing.assert_close(m.head(h, bb), bb.logits(bb.norm(h)))


def test_cached_drafting_equals_whole_sequence():
    """Fed in pieces through its per-generation KV cache, the head gives the same logits as on the whole chunk."""
    m = make_tiny("mistral")
    bb = m.backbone
    m.set_head("layer", exit_layer=2, num_layers=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        h = bb.run_layers(bb.embed(torch.tensor([m.encode("The quick brown fox jumps over")])), 0, 2)
        whole = m.head(h, bb)
        state = m.head.new_state(bb, 64)
        parts = [m.head(h[:, :4], bb, state, pos0=0), m.head(h[:, 4:5], bb, state, pos0=4), m.head(h[:, 5:], bb, state, pos0=5)]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-4, atol=1e-5)


def test_bad_settings_are_one_line_errors():
    m = make_tiny("llama")
    with pytest.raises(SelfSpecError, match="head.init_from"):
        m.set_head("layer", exit_layer=2, init_from=99)
    with pytest.raises(SelfSpecError, match="head.num_layers"):
        m.set_head("layer", exit_layer=2, num_layers=0)
    g = make_tiny("gemma3_text")
    with pytest.raises(SelfSpecError, match="llama-family"):
        g.set_head("layer", exit_layer=2, init_from=2)
