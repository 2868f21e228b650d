"""Top-1 agreement of low-precision whole-model drafts with the float model, teacher-forced, on the model as loaded
and on a copy nudged off the 4-bit grid (issue 19).

Every testbed model here is a de-quantized 4-bit GGUF: its weights sit on a 4-bit grid (blocks of 32), which an
int4 copy in groups of 32 can land on again, and which flatters int8 too. A native bf16 checkpoint has no such grid.
The off-grid copy is what `model.off_grid=NUDGE` loads (selfspec/model/loading.py: nudge_off_grid): every weight of
every block of 32 plus uniform noise of +-NUDGE x the block's 4-bit step ((max - min) / 15), so no weight stays on
its grid point.

    python eval/offgrid_agreement.py --model smollm2_135m --prompts ../shared/data/spec_bench/question.jsonl \
        --limit 24 --nudge 0.5 [--precisions int8 int4_mlp int4 int8_a8 int4_mlp_a8 int4_a8]

Prints one markdown table: precision x (as loaded, off-grid) top-1 agreement over every position of the texts
(prompt + the model's own 128-token greedy answer).
"""

from __future__ import annotations

import argparse
import json

import torch

from selfspec.api import SelfSpecModel
from selfspec.decoding.config import DecodeConfig
from selfspec.model.loading import nudge_off_grid
from selfspec.model.quant import PRECISIONS


@torch.inference_mode()
def agreement(model: SelfSpecModel, texts: list[list[int]], precisions: list[str]) -> dict[str, float]:
    bb = model.backbone
    hits = {p: 0 for p in precisions}
    total = 0
    for ids in texts:
        x = torch.tensor([ids])
        ref = bb.logits(bb.norm(bb.run_layers(bb.embed(x), 0, bb.num_layers)))[0].argmax(-1)
        for p in precisions:
            q = bb.quantized(p)
            h = bb.run_layers(bb.embed(x), 0, bb.num_layers, quant=q)
            hits[p] += int((bb.logits(bb.norm(h), quant=q)[0].argmax(-1) == ref).sum())
        total += len(ids)
    return {p: hits[p] / total for p in precisions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompts", required=True, help="a Spec-Bench question.jsonl")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--nudge", type=float, default=0.5)
    ap.add_argument("--precisions", nargs="+", default=["int8", "int4_mlp", "int4", "int8_a8", "int4_mlp_a8", "int4_a8"],
                    help=f"draft precisions to score (allowed: {', '.join(p for p in PRECISIONS if p != 'full')})")
    args = ap.parse_args()
    for p in args.precisions:
        if p not in PRECISIONS or p == "full":
            ap.error(f"--precisions: {p!r}: allowed {', '.join(q for q in PRECISIONS if q != 'full')}")
    m = SelfSpecModel.from_pretrained(args.model, head=None)
    questions = [json.loads(line) for line in open(args.prompts)][: args.limit]
    cfg = DecodeConfig(strategy="autoregressive", max_new_tokens=args.max_new_tokens)
    texts = []
    for q in questions:
        ids = m.encode([{"role": "user", "content": q["turns"][0]}])
        texts.append(ids + m.decoder.generate(ids, cfg, m.eos_ids)[0])
    precisions = args.precisions
    loaded = agreement(m, texts, precisions)
    nudge_off_grid(m.hf_model, args.nudge)  # what model.off_grid=NUDGE loads
    m.backbone._quant.clear()  # new copies of the nudged weights
    off = agreement(m, texts, precisions)
    n = sum(len(t) for t in texts)
    print(f"| draft weights | agreement, as loaded | off the 4-bit grid (nudge {args.nudge}) |\n|---|---:|---:|")
    for p in precisions:
        print(f"| {p} | {loaded[p]:.1%} | {off[p]:.1%} |")
    print(f"\n{len(texts)} texts, {n} positions, model {args.model}")


if __name__ == "__main__":
    main()
