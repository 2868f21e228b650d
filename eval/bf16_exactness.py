"""How exact is greedy self-speculative decoding in each dtype? (issue 12, README "Exactness")

For the four supported architectures as tiny random models (tests/conftest.py), several exit layers and
prompts, and each dtype, this compares selfspec's greedy output with HF `generate`'s and, at every first
divergence, measures how close the target was to a tie there: the margin between HF's chosen token and
selfspec's token in HF's own logits at that step, in units in the last place (ulp) of the dtype at that
logit's magnitude (and of bfloat16).

Why divergences can happen at all: verification scores k+1 positions in one forward pass, HF scores one;
the matmuls then add in another order, and in a half-precision dtype two logits that are within a rounding
step of each other can swap. Such a swap is a near-tie of the target's own logits, not a drafting error.

    python eval/bf16_exactness.py                       # the table in BENCHMARKS.md
    python eval/bf16_exactness.py --dtypes bfloat16 --prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny models of the test suite

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARCHS = ("llama", "qwen2", "mistral", "gemma3_text")
DTYPES = ("float32", "float16", "bfloat16")
MANTISSA_BITS = {"float32": 23, "float16": 10, "bfloat16": 7}
# A divergence counts as a near-tie when selfspec's token is HF's first or second choice and the two are at most
# this many ulps of the dtype apart. Measured (BENCHMARKS.md): correct runs diverge at <= 5 bf16 ulps / 2 fp16 ulps;
# a planted verification bug (every draft accepted) gives 12-177 bf16 ulps.
NEAR_TIE_ULPS = 8
PROMPTS = ("The quick brown fox", "Once upon a time", "def fibonacci(n):", "Why is the sky blue?",
           "1, 2, 3, 4,", "Translate to French: cheese", "import numpy as np", "Dear Sir or Madam,")


def ulp(x: float, dtype: str) -> float:
    """The spacing of `dtype` numbers at magnitude |x| (normal range)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - MANTISSA_BITS[dtype])


@dataclass
class Run:
    arch: str
    dtype: str
    exit_layer: int
    prompt: str
    identical: bool
    position: int | None = None  # first divergent new token
    margin: float | None = None  # HF logit of HF's token minus HF logit of selfspec's token there
    margin_ulps: float | None = None  # in ulps of the run's dtype
    margin_bf16_ulps: float | None = None
    rank: int | None = None  # of selfspec's token in HF's logits there (1 = tied with HF's choice)

    @property
    def near_tie(self) -> bool:
        return self.identical or (self.margin is not None and self.rank <= 2 and self.margin_ulps <= NEAR_TIE_ULPS)


def compare(m, prompt: str, exit_layer: int, draft_len: int, max_new_tokens: int, dtype: str, arch: str) -> Run:
    m.set_head("lens", exit_layer=exit_layer)
    ids = m.encode(prompt)
    ours = m.generate(ids, max_new_tokens=max_new_tokens, draft_len=draft_len).token_ids
    with torch.no_grad():
        out = m.hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=m.tokenizer.pad_token_id)
    ref = out.sequences[0, len(ids):].tolist()
    if ours == ref:
        return Run(arch, dtype, exit_layer, prompt, True)
    j = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if j >= min(len(ours), len(ref)):  # one stopped (EOS) where the other went on: no token to compare
        return Run(arch, dtype, exit_layer, prompt, False, j)
    logits = out.logits[j][0].float()
    top = float(logits[ref[j]])
    margin = top - float(logits[ours[j]])
    rank = int((logits > logits[ours[j]]).sum()) + 1
    return Run(arch, dtype, exit_layer, prompt, False, j, margin, margin / ulp(top, dtype), margin / ulp(top, "bfloat16"), rank)


def measure(archs=ARCHS, dtypes=DTYPES, exit_layers=(2, 4), prompts=PROMPTS[:4], draft_len: int = 4,
            max_new_tokens: int = 32) -> list[Run]:
    from conftest import tiny_spec

    from selfspec.api import SelfSpecModel
    from selfspec.model.loading import ModelConfig

    runs = []
    for dtype in dtypes:
        for arch in archs:
            cfg = ModelConfig(name=f"tiny-{arch}", random_init=tiny_spec(arch), seed=0, dtype=dtype)
            m = SelfSpecModel.from_pretrained(cfg, head=None)
            for E in exit_layers:
                for prompt in prompts:
                    runs.append(compare(m, prompt, E, draft_len, max_new_tokens, dtype, arch))
    return runs


def table(runs: list[Run]) -> str:
    lines = ["| dtype | runs | identical to HF generate | divergences | all at near-ties | largest margin (dtype ulps) "
             "| largest margin (bf16 ulps) | selfspec's token, rank in HF's logits |",
             "|---|---|---|---|---|---|---|---|"]
    for dtype in dict.fromkeys(r.dtype for r in runs):
        rs = [r for r in runs if r.dtype == dtype]
        div = [r for r in rs if not r.identical]
        margins = [r.margin_ulps for r in div if r.margin_ulps is not None]
        bf16 = [r.margin_bf16_ulps for r in div if r.margin_bf16_ulps is not None]
        lines.append(f"| {dtype} | {len(rs)} | {len(rs) - len(div)} ({(len(rs) - len(div)) / len(rs):.0%}) | {len(div)} "
                     f"| {'yes' if all(r.near_tie for r in div) else 'NO'} | {max(margins) if margins else '-'} "
                     f"| {max(bf16) if bf16 else '-'} | {max((r.rank for r in div if r.rank), default='-')} (max) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    ap.add_argument("--exit-layers", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(PROMPTS)} built-in prompts")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    runs = measure(a.archs, a.dtypes, a.exit_layers, PROMPTS[: a.prompts], a.draft_len, a.max_new_tokens)
    for r in runs:
        if not r.identical:
            margin = "-" if r.margin is None else (f"{r.margin:.3g} = {r.margin_ulps:.2f} ulps ({r.margin_bf16_ulps:.2f} bf16 ulps), "
                                                   f"selfspec's token HF's choice #{r.rank}")
            print(f"{r.dtype} {r.arch} E={r.exit_layer} {r.prompt!r}: first divergence at new token {r.position}, margin {margin}")
    print(table(runs))


if __name__ == "__main__":
    main()
