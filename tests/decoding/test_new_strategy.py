"""ARCHITECTURE.md's worked example, "How to add a drafting strategy": one module (a Proposer subclass with
`@register_proposer`) and one conf/decode/<name>.yaml. The strategy is chosen from Hydra, decodes losslessly, and its
draft length follows the rounds as its docstring says. The code and yaml are read from ARCHITECTURE.md itself."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding.proposers import proposer_names, register_proposer, unregister_proposer

ARCHITECTURE = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"
SECTION = ARCHITECTURE.read_text().split("## How to add a drafting strategy", 1)[1]
CODE = re.findall(r"```python\n(.*?)```", SECTION, flags=re.S)[0]
YAML = re.findall(r"```yaml\n(.*?)```", SECTION, flags=re.S)[0]

_example = types.ModuleType("adaptive_chain")  # what selfspec/decoding/proposers/adaptive_chain.py would be
sys.modules[_example.__name__] = _example
exec(compile(CODE, str(ARCHITECTURE), "exec"), _example.__dict__)  # registers "adaptive_chain"
AdaptiveChain = _example.AdaptiveChain
unregister_proposer("adaptive_chain")  # the fixture registers it for each test


@pytest.fixture
def adaptive():
    register_proposer("adaptive_chain")(AdaptiveChain)
    try:
        yield
    finally:
        unregister_proposer("adaptive_chain")


def test_new_strategy_end_to_end(tmp_path, adaptive):
    from hydra import compose, initialize_config_dir

    from selfspec.cli.config import decode_config
    from selfspec.utils.paths import conf_dir

    assert "adaptive_chain" in proposer_names()
    (tmp_path / "conf" / "decode").mkdir(parents=True)
    (tmp_path / "conf" / "decode" / "adaptive.yaml").write_text(YAML)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("generate", overrides=[f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "decode=adaptive",
                                             "decode.max_new_tokens=40"])
    dcfg = decode_config(cfg.decode)
    assert dcfg.proposer == "adaptive_chain" and dcfg.draft_len == 8

    m = make_tiny("llama")
    m.set_head("lens", exit_layer=3)
    randomize_head(m.head, seed=3, std=0.3)  # a draft that is right sometimes, wrong sometimes
    ids = m.encode("A new drafting strategy")
    ref = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=258,
                              eos_token_id=257)[0, len(ids):].tolist()
    seen = []
    real = AdaptiveChain.propose

    def recording(self, state):
        seen.append(self.k)
        return real(self, state)

    AdaptiveChain.propose = recording
    try:
        got = m.generate(ids, decode=dcfg)
    finally:
        AdaptiveChain.propose = real
    assert got.token_ids == ref  # lossless
    # K starts at draft_len and follows the rounds: it shrank after a rejection and never exceeded draft_len
    assert seen[0] == 8 and min(seen) < 8 and max(seen) <= 8 and got.stats["drafted"] > 0


def test_unknown_strategy_is_one_line():
    from selfspec.decoding.config import DecodeConfig
    from selfspec.errors import SelfSpecError

    with pytest.raises(SelfSpecError, match=r"decode.proposer='nope': allowed .*head_chain"):
        DecodeConfig(proposer="nope")
