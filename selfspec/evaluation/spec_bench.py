"""Spec-Bench's answer files, one per method, written beside results.jsonl (`model_answer/<method>.jsonl`).

Spec-Bench (hemingkx/Spec-Bench, evaluation/eval.py) writes one JSON line per question:

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [answer per turn], "decoding_steps": [per turn], "new_tokens": [per turn],
                  "wall_time": [seconds per turn], "accept_lengths": [tokens per verify step]}]}

sorted by question_id. Its evaluation/speed.py reads a method's file (sum(new_tokens) / sum(wall_time) per
question, averaged; mean accept_lengths) against a baseline's (the baseline's tokens re-counted from its turns with
the tokenizer), and evaluation/equal.py compares the `turns` of two files line by line. So
`python evaluation/speed.py --file-path model_answer/selfspec.jsonl --base-path model_answer/autoregressive.jsonl
--tokenizer-path MODEL` reads a selfspec run as it reads its own.

What each field is here: turns = each turn's answer text (special tokens dropped, stripped, as Spec-Bench does);
decoding_steps = the target's full-depth forward passes of the turn; new_tokens = the turn's new tokens; wall_time =
the same clock around the whole call that results.jsonl's seconds are; category = the question file's own category
(MT-bench's eight, not the `mt_bench` task name a prompts=spec_bench run groups them under, which speed.py's
mt_bench filter would not find). accept_lengths = accepted drafts + 1 per verify step, rebuilt from the per-position
counts the engine keeps (not the steps' order; their mean, what speed.py prints, is exact).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from selfspec.utils.io import atomic_write_text, safe_name

ANSWER_DIR = "model_answer"


def accept_lengths(stats: dict) -> list[int]:
    """Tokens per verify step (accepted drafts + the target's own token), from the counts: steps that accepted
    exactly j drafts = accepted_per_position[j-1] - accepted_per_position[j] (a step accepts a prefix)."""
    steps = int(stats.get("verify_steps") or 0)
    per_pos = [int(x) for x in stats.get("accepted_per_position") or []]
    at_least = [steps, *per_pos, 0]  # at_least[j]: steps that accepted j or more drafts
    out: list[int] = []
    for j in range(len(at_least) - 1):
        out += [j + 1] * max(0, at_least[j] - at_least[j + 1])
    return out


def _question_id(prompt_id: str):
    return int(prompt_id) if str(prompt_id).lstrip("-").isdigit() else prompt_id


def answer_record(rec: dict, model_id: str) -> dict:
    """One results.jsonl record -> Spec-Bench's answer line."""
    stats = rec["stats"]
    turns = rec.get("turn_texts") or [rec["text"]]
    n = len(turns)
    new_tokens = rec.get("turn_new_tokens") or [stats["new_tokens"]]
    steps = rec.get("turn_verify_steps") or [stats.get("verify_steps", 0)] * (n == 1)
    wall = rec.get("turn_seconds") or [stats["seconds"]] * (n == 1)
    return {
        "question_id": _question_id(rec["prompt_id"]),
        "category": rec.get("source_category") or rec["category"],
        "answer_id": uuid.uuid4().hex[:22],
        "model_id": model_id,
        "choices": [{"index": 0, "turns": [t.strip() for t in turns], "decoding_steps": [int(s) for s in steps],
                     "new_tokens": [int(t) for t in new_tokens], "wall_time": [float(w) for w in wall],
                     "accept_lengths": accept_lengths(stats)}],
        "tstamp": time.time(),
    }


def write_answers(records: list[dict], out_dir: Path, model_name: str, dtype: str, temperature: float) -> dict[str, Path]:
    """model_answer/<method>.jsonl for every method of `records` -> {method: file}. model_id is Spec-Bench's
    `<model>-<method>-<dtype>-temperature-<T>` (T = 0 for greedy methods, the HF ones always)."""
    by_method: dict[str, list[dict]] = {}
    for rec in records:
        by_method.setdefault(rec["method"], []).append(rec)
    files: dict[str, Path] = {}
    used: set[str] = set()
    for method, recs in by_method.items():
        name = safe_name(method)
        while name in used:  # two variants that spell the same file name
            name += "_"
        used.add(name)
        answers = [answer_record(r, f"{model_name}-{name}-{dtype}-temperature-{temperature if r.get('sampled') else 0.0}")
                   for r in recs]
        if all(isinstance(a["question_id"], int) for a in answers):  # Spec-Bench's reorg_answer_file: by question id
            answers.sort(key=lambda a: a["question_id"])
        path = Path(out_dir) / ANSWER_DIR / f"{name}.jsonl"
        atomic_write_text(path, "".join(json.dumps(a) + "\n" for a in answers))
        files[method] = path
    return files
