"""selfspec.api and DecodeConfig: stop strings, decode values and prompt ids that used to slip through."""

from __future__ import annotations

import pytest
import torch

from selfspec.cli.config import decode_config
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError


def test_a_stop_string_is_one_string(tiny_llama):
    """generate(stop="Ko") and decode.stop='Blue' used to be split into characters, stopping at the first
    matching letter."""
    m = tiny_llama
    m.set_head("lens", exit_layer=2)
    ids = m.encode("The quick brown fox")
    full = m.generate(ids, max_new_tokens=32, draft_len=3)
    text = m.tokenizer.decode(full.token_ids)
    # a 3-character stop string whose first character occurs earlier than the string itself
    start = next(i for i in range(1, len(text) - 3) if text[i] in text[:i] and text.index(text[i : i + 3]) == i)
    stop = text[start : start + 3]
    got = m.generate(ids, max_new_tokens=32, draft_len=3, stop=stop)
    assert got.token_ids == m.generate(ids, max_new_tokens=32, draft_len=3, stop=[stop]).token_ids
    assert stop in m.tokenizer.decode(got.token_ids) and stop not in m.tokenizer.decode(got.token_ids[:-1])
    by_char = m.generate(ids, max_new_tokens=32, draft_len=3, stop=list(stop))  # what the old code did
    assert len(by_char.token_ids) < len(got.token_ids)
    assert DecodeConfig(stop="Blue").stop == ["Blue"]


def test_decode_config_from_hydra_values():
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("generate", overrides=["decode.stop=Blue", "decode.seed=3"])
        assert decode_config(cfg.decode).stop == ["Blue"]
        for override, message in [
            ("decode.seed=abc", r"decode.seed='abc': must be an integer or null"),
            ("decode.temperature=1e-45", r"decode.temperature=1e-45: must be 0 \(greedy\) or >= 0.0001"),
            ("decode.temperature=abc", r"decode.temperature=abc: must be >= 0"),
            ("decode.draft_len=2.5", r"decode.draft_len=2.5: must be an integer >= 1"),
            ("decode.stop=[1,2]", r"decode.stop=\[1, 2\]: must be a string or a list of strings"),
        ]:
            with pytest.raises(SelfSpecError, match=message):
                decode_config(compose("generate", overrides=[override]).decode)


def test_smallest_temperature_samples_the_argmax(tiny_llama):
    """At the smallest allowed temperature, logits / T stays finite and sampling is the greedy choice."""
    m = tiny_llama
    m.set_head("medusa", exit_layer=2)
    ids = m.encode("Once upon a time")
    greedy = m.generate(ids, max_new_tokens=16, draft_len=3)
    cold = m.generate(ids, max_new_tokens=16, draft_len=3, temperature=1e-4, seed=3)
    assert cold.token_ids == greedy.token_ids


def test_prompt_ids_outside_the_vocabulary(tiny_llama):
    m = tiny_llama
    m.set_head("lens", exit_layer=2)
    for bad, shown in (([5, 320], 320), ([5, -1], -1), (torch.tensor([3, 99999]), 99999)):
        with pytest.raises(SelfSpecError, match=rf"prompt: token id {shown} is outside the vocabulary \[0, 320\)"):
            m.generate(bad, max_new_tokens=2)
    with pytest.raises(SelfSpecError, match="must have an integer dtype"):
        m.generate(torch.tensor([1.5, 2.0]), max_new_tokens=2)
    with pytest.raises(SelfSpecError, match="prompt: give a string"):
        m.generate([1, True, 3.0], max_new_tokens=2)
    assert len(m.generate([5, 319], max_new_tokens=2).token_ids) == 2
