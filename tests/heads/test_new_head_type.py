"""ARCHITECTURE.md's worked example, "How to add a head type": one module (a config dataclass, a head class,
`@register_head`) and one conf/head/<type>.yaml. The head builds from Python and from Hydra, drafts losslessly,
saves, loads, and offers training what it needs, with no other file touched. The code and yaml are read from
ARCHITECTURE.md itself."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.heads import head_types, load_head, register_head, save_head, unregister_head

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", ARCHITECTURE.read_text(), flags=re.S)


# ---- the module and the conf file, exactly as ARCHITECTURE.md shows them (a stale example fails here)
YAML = _blocks("yaml")[0]
_example = types.ModuleType("scaled_lens")  # what selfspec/heads/scaled_lens.py would be
sys.modules[_example.__name__] = _example  # dataclasses look their module up
exec(compile(_blocks("python")[0], str(ARCHITECTURE), "exec"), _example.__dict__)  # registers "scaled_lens"
ScaledLensConfig, ScaledLensHead = _example.ScaledLensConfig, _example.ScaledLensHead
unregister_head("scaled_lens")  # the fixture registers it for each test


@pytest.fixture
def scaled_lens():
    register_head("scaled_lens", ScaledLensConfig)(ScaledLensHead)
    try:
        yield
    finally:
        unregister_head("scaled_lens")


def test_new_head_type_end_to_end(tmp_path, scaled_lens):
    from hydra import compose, initialize_config_dir

    from selfspec.cli.config import head_config
    from selfspec.utils.paths import conf_dir

    assert "scaled_lens" in head_types()
    # the conf file, on Hydra's search path as if it were conf/head/scaled_lens.yaml
    (tmp_path / "conf" / "head").mkdir(parents=True)
    (tmp_path / "conf" / "head" / "scaled_lens.yaml").write_text(YAML)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("generate", overrides=[f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "head=scaled_lens",
                                             "head.init_scale=0.5", "head.exit_layer=2"])
    hcfg = head_config(cfg.head)
    assert type(hcfg) is ScaledLensConfig and hcfg.init_scale == 0.5

    m = make_tiny("llama")
    m.set_head(hcfg)
    assert type(m.head) is ScaledLensHead and m.head.exit_layer == 2
    assert float(m.head.scale.detach()[0]) == 0.5
    randomize_head(m.head, seed=7, std=1.0)
    # lossless: greedy self-speculation with the new head == HF generate
    ids = m.encode("A new head type")
    ref = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, pad_token_id=258,
                              eos_token_id=257)[0, len(ids):].tolist()
    got = m.generate(ids, max_new_tokens=24, draft_len=3)
    assert got.token_ids == ref and got.stats["drafted"] > 0
    # training sees its parameters; positions of cached layer-E states are what it is fed
    assert list(m.head.trainable_parameters()) == ["scale"] and m.head.training_input == "positions"
    # save and load: the registry rebuilds it from head_config.json
    path = save_head(m.head, tmp_path / "head", m.backbone)
    assert json.loads((path / "head_config.json").read_text())["type"] == "scaled_lens"
    loaded = load_head(path, m.backbone)
    assert type(loaded) is ScaledLensHead and torch.equal(loaded.scale, m.head.scale)
    m.set_head(str(path))
    assert m.generate(ids, max_new_tokens=24, draft_len=3).token_ids == ref


def test_new_head_type_bad_value(scaled_lens):
    from selfspec.errors import SelfSpecError
    from selfspec.heads import make_head_config

    with pytest.raises(SelfSpecError, match=r"head.init_scale=-1: must be a number > 0"):
        make_head_config("scaled_lens", init_scale=-1)
    with pytest.raises(SelfSpecError, match=r"unknown key\(s\) num_blocks for head type 'scaled_lens'"):
        make_head_config("scaled_lens", num_blocks=2)
