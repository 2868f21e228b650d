"""What "lossless" means in each dtype (README, Exactness): float32 greedy output is identical to HF
`generate`; in float16 / bfloat16 it may differ only where the target itself was at a near-tie (the two
tokens within NEAR_TIE_ULPS ulps of each other in HF's own logits), never because a wrong draft was accepted.
Measured by eval/bf16_exactness.py, whose numbers are in BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from test_sampling import planted

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exactness():
    spec = importlib.util.spec_from_file_location("bf16_exactness", ROOT / "eval" / "bf16_exactness.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def small(mod, dtypes, **kw):
    return mod.measure(dtypes=dtypes, exit_layers=(2,), prompts=mod.PROMPTS[:3], max_new_tokens=24, **kw)


def test_float32_is_identical_to_hf_generate(exactness):
    runs = small(exactness, ("float32",))
    assert len(runs) == 12 and all(r.identical for r in runs), [r for r in runs if not r.identical]


def test_half_precision_differs_only_at_near_ties(exactness):
    runs = small(exactness, ("bfloat16", "float16"))
    assert len(runs) == 24
    bad = [r for r in runs if not r.near_tie]
    assert not bad, bad


def test_a_real_acceptance_bug_is_not_a_near_tie(exactness):
    """The check has power: accepting every draft (a verifier bug) gives divergences with large margins."""
    def accept_all(drafts, target_logits):
        k = drafts.shape[0]
        return k, target_logits[k].argmax(-1)

    with planted("greedy_accept", accept_all):
        runs = small(exactness, ("bfloat16",), )
    assert any(not r.near_tie for r in runs)
