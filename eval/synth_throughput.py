"""Synthesis throughput: answer tokens per minute of the target answering the same prompts, side by side.

    python eval/synth_throughput.py                       # SmolLM2-135M, 32 Magpie prompts (data=selfgen_tasks)
    python eval/synth_throughput.py --prompts 96 --repeats 3 --methods hf,ours
    python eval/synth_throughput.py --prompt-file FILE    # a JSON list of prompt strings instead

Methods (all greedy, top-k targets recorded, same prompts, run interleaved in rotating order so that load
from other jobs hits each about equally):
  hf         the previous path: HF `generate`, left-padded batches of --hf-batch prompts sorted by length,
             each batch running until its longest row stops (synthesis.answer_prompts_hf)
  hf_static  the same with HF's static KV cache (cache_implementation="static")
  ours       synthesis.generate: ragged rows, continuous refill, token-budget batches (--batch rows)
  ours_bf16  the same on a bfloat16 copy of the target (data.synth_dtype=bfloat16), its top candidates
             recomputed with the float32 LM head; its answers are then scored by the float32 target
             (teacher-forced, one pass) to report how often the float32 argmax is the token written
             ("fidelity") and the mean KL(float32 || recorded top-k) over the recorded tokens
Each run is timed twice: wall clock, and the CPU time of this process (all its threads). On a machine that
other jobs share, wall-clock rates swing with their load; the CPU time a method needs for its tokens does much
less (OMP_WAIT_POLICY=PASSIVE: waiting threads sleep rather than spin), so the summary's ratios are given both
ways, and "tokens per CPU-minute" x cores is what an idle machine of that many cores would reach at best.
Prints one line per run and a summary (median rates per method, the ratio to `hf` per repeat); --out writes it
all as JSON. Answers are compared token by token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-file", default=None, help="JSON list of prompt strings (default: sample Magpie prompts)")
    ap.add_argument("--max-new", type=int, default=128, help="answer tokens at most (experiment=default: 128)")
    ap.add_argument("--methods", default="hf,ours")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf-batch", type=int, default=32, help="the previous default, data.batch_size=32")
    ap.add_argument("--batch", type=int, default=64, help="ours: rows decoded together")
    ap.add_argument("--token-budget", type=int, default=24576)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from omegaconf import OmegaConf

    from selfspec.api import SelfSpecModel
    from selfspec.utils.paths import conf_dir
    from selfspec.training import synthesis as S

    model = SelfSpecModel.from_pretrained(args.model, head=None)
    bb, tok = model.backbone, model.tokenizer
    eos = model.eos_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    batch = S.BatchSettings(max_batch=args.batch, token_budget=args.token_budget)
    if args.prompt_file:
        texts = json.load(open(args.prompt_file))[: args.prompts]
    else:  # the data=selfgen_tasks recipe: Magpie rows cycling through its system messages, 48 tokens at most
        systems = list(OmegaConf.load(conf_dir() / "data" / "selfgen_tasks.yaml").system_prompts)
        t = time.perf_counter()
        texts = S.sample_prompts(bb, tok, args.prompts, 48, 1.0, 0.95, batch, args.seed, eos, False, systems=systems)
        print(f"sampled {len(texts)} Magpie prompts in {time.perf_counter() - t:.1f} s", flush=True)
    ids = [model.encode(x, chat=True) for x in texts]
    print(f"prompts: {len(ids)}, prompt tokens {sum(map(len, ids))} (min {min(map(len, ids))}, max {max(map(len, ids))})", flush=True)

    runners = {
        "hf": lambda: S.answer_prompts_hf(model.hf_model, ids, args.max_new, 0.0, 1.0, args.hf_batch, 0, eos, pad, args.topk),
        "hf_static": lambda: S.answer_prompts_hf(model.hf_model, ids, args.max_new, 0.0, 1.0, args.hf_batch, 0, eos, pad,
                                                 args.topk, cache_implementation="static"),
        "ours": lambda: S.answer_prompts(bb, ids, args.max_new, 0.0, 1.0, batch, 0, eos, args.topk, progress=False),
    }
    if "ours_bf16" in args.methods:
        bb16, head32 = S.synthesis_backbone(bb, "bfloat16")
        runners["ours_bf16"] = lambda: S.answer_prompts(bb16, ids, args.max_new, 0.0, 1.0, batch, 0, eos, args.topk,
                                                        progress=False, exact_head=head32)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in runners]
    if unknown:
        print(f"error: --methods: unknown {unknown}; allowed {', '.join(runners)}", file=sys.stderr)
        return 2
    runs: list[dict] = []
    answers: dict[str, list] = {}
    for r in range(args.repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            t, c = time.perf_counter(), time.process_time()
            out = runners[m]()
            dt, dc = time.perf_counter() - t, time.process_time() - c
            n = sum(len(a.response) for a in out)
            answers.setdefault(m, out)
            runs.append({"repeat": r, "method": m, "tokens": n, "seconds": dt, "cpu_seconds": dc,
                         "tokens_per_min": n / dt * 60, "tokens_per_cpu_min": n / dc * 60})
            print(f"repeat {r} {m:9s} {n:6d} answer tokens in {dt:7.1f} s = {n / dt * 60:7.0f} tokens/min; "
                  f"{dc:7.1f} CPU s = {n / dc * 60:7.0f} tokens/CPU-min", flush=True)

    summary = {m: statistics.median(x["tokens_per_min"] for x in runs if x["method"] == m) for m in methods}
    summary_cpu = {m: statistics.median(x["tokens_per_cpu_min"] for x in runs if x["method"] == m) for m in methods}
    ratios, ratios_cpu = {}, {}
    if "hf" in methods:
        def rate(r, m, key):
            return next(x for x in runs if x["repeat"] == r and x["method"] == m)[key]

        for m in methods:
            if m != "hf":
                ratios[m] = [rate(r, m, "tokens_per_min") / rate(r, "hf", "tokens_per_min") for r in range(args.repeats)]
                ratios_cpu[m] = [rate(r, m, "tokens_per_cpu_min") / rate(r, "hf", "tokens_per_cpu_min") for r in range(args.repeats)]
    same = {}  # share of prompts whose answer is token for token the reference's (hf, else the first method)
    ref = "hf" if "hf" in methods else methods[0]
    for m in methods:
        if m != ref:
            same[f"{m}_vs_{ref}"] = sum(x.response == y.response for x, y in zip(answers[ref], answers[m])) / len(ids)
    fidelity = {}
    if "ours_bf16" in answers:
        out = answers["ours_bf16"]
        scored = S.score_sequences(bb, [(p, a.response) for p, a in zip(ids, out)], args.topk, progress=False)
        hit = tot = 0
        kl = 0.0
        for a, (t_ids, t_lp) in zip(out, scored):
            n = len(a.response)
            hit += int((t_ids[:, 0] == torch.tensor(a.response)).sum())
            tot += n
            # KL(float32 || recorded) on the float32 top-k, the recorded log-probabilities looked up by id (an id
            # the recorded top-k lacks gets the recorded k-th value, an upper bound of its probability)
            rec = a.topk_logprobs[:, -1:].expand(n, bb.vocab_size).clone()
            rec.scatter_(1, a.topk_ids, a.topk_logprobs)
            p32 = t_lp.exp()
            kl += float((p32 * (t_lp - rec.gather(1, t_ids))).sum())
        fidelity = {"argmax_is_token": hit / tot, "kl_topk_nats": kl / tot, "positions": tot}
        print(f"ours_bf16 fidelity: the float32 argmax is the written token at {hit / tot:.4f} of {tot} positions, "
              f"KL(float32 || recorded, top-{args.topk}) {kl / tot:.5f} nats")
    print("median tokens/min: " + ", ".join(f"{m} {v:.0f}" for m, v in summary.items()))
    print("median tokens/CPU-min: " + ", ".join(f"{m} {v:.0f}" for m, v in summary_cpu.items()))
    for m in ratios:
        print(f"{m} / hf per repeat: wall " + ", ".join(f"{x:.2f}x" for x in ratios[m])
              + "; CPU " + ", ".join(f"{x:.2f}x" for x in ratios_cpu[m]))
    print("identical answers: " + ", ".join(f"{k} {v:.3f}" for k, v in same.items()))
    if args.out:
        json.dump({"args": vars(args), "runs": runs, "median_tokens_per_min": summary, "ratio_to_hf": ratios,
                   "median_tokens_per_cpu_min": summary_cpu, "ratio_to_hf_cpu": ratios_cpu,
                   "identical": same, "fidelity": fidelity, "threads": torch.get_num_threads(), "load_avg": os.getloadavg()},
                  open(args.out, "w"), indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
