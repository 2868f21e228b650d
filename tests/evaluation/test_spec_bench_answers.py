"""Spec-Bench's answer format beside results.jsonl (selfspec/evaluation/spec_bench.py): a small eval on a tiny model,
then Spec-Bench's own evaluation/speed.py and evaluation/equal.py computations (re-implemented here as they are
written there) read the files it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from selfspec.evaluation.spec_bench import accept_lengths
from selfspec.model.loading import tiny_tokenizer

# Spec-Bench's question.jsonl layout: an MT-bench question (its own category, two turns) and three task questions
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about rain.", "Now make it rhyme."]},
    {"question_id": 201, "category": "translation", "turns": ["Translate to German: the house is small."]},
    {"question_id": 361, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 121, "category": "coding", "turns": ["Write a function that adds two numbers."]},
]
MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
TASKS = ["mt_bench", "translation", "qa", "overall"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from test_eval import TINY, run_app

    tmp = tmp_path_factory.mktemp("specbench")
    questions = tmp / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    out = tmp / "run"
    proc = run_app([*TINY, "head=lens", "head.exit_layer=2", "decode.draft_len=3", "decode.max_new_tokens=10",
                    "methods=[autoregressive,selfspec]", "prompts=spec_bench", f"prompts.path={questions}",
                    f"hydra.run.dir={out}"], tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- Spec-Bench's evaluation/speed.py, as written there (data selection per task, speeds, baseline re-counted)
def _select(path: Path, task: str) -> list[dict]:
    data = []
    for obj in _read(path):
        if task == "overall" or (task == "mt_bench" and obj["category"] in MT_BENCH) or obj["category"] == task:
            data.append(obj)
    return data


def speed(jsonl_file: Path, jsonl_file_base: Path, tokenizer, task: str):
    speeds, accept_lengths_list = [], []
    for datapoint in _select(jsonl_file, task):
        tokens = sum(datapoint["choices"][0]["new_tokens"])
        times = sum(datapoint["choices"][0]["wall_time"])
        accept_lengths_list.extend(datapoint["choices"][0]["accept_lengths"])
        speeds.append(tokens / times)
    speeds0 = []
    for datapoint in _select(jsonl_file_base, task):
        answer = datapoint["choices"][0]["turns"]
        tokens = sum(len(tokenizer(i).input_ids) - 1 for i in answer)
        times = sum(datapoint["choices"][0]["wall_time"])
        speeds0.append(tokens / times)
    return np.array(speeds).mean(), np.array(speeds0).mean(), np.array(speeds).mean() / np.array(speeds0).mean(), accept_lengths_list


# ---- Spec-Bench's evaluation/equal.py: str(turns) per line, then the two texts line by line
def get_content(jsonfile_path: Path, output_path: Path) -> None:
    contents = [str(d["choices"][0]["turns"]) for d in _read(jsonfile_path)]
    output_path.write_text("".join(c + "\n" for c in contents))


def txt_compare(file_path1: Path, file_path2: Path) -> bool:
    lines1, lines2 = file_path1.read_text().splitlines(True), file_path2.read_text().splitlines(True)
    return all(l1 == l2 for l1, l2 in zip(lines1, lines2))


def test_one_answer_file_per_method_in_spec_bench_layout(run_dir: Path):
    files = sorted((run_dir / "model_answer").iterdir())
    assert [f.name for f in files] == ["autoregressive.jsonl", "selfspec.jsonl"]
    results = _read(run_dir / "results.jsonl")
    for f in files:
        method = f.stem
        answers = _read(f)
        assert [a["question_id"] for a in answers] == sorted(q["question_id"] for q in QUESTIONS)  # as reorg_answer_file
        assert [a["category"] for a in answers] == ["writing", "coding", "translation", "qa"]  # MT-bench's own
        for a in answers:
            assert set(a) == {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
            assert a["model_id"] == f"tiny-{method}-float32-temperature-0.0"
            (choice,) = a["choices"]
            assert set(choice) == {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}
            q = next(q for q in QUESTIONS if q["question_id"] == a["question_id"])
            rec = next(r for r in results if r["method"] == method and r["prompt_id"] == str(q["question_id"]))
            n = len(q["turns"])
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == len(choice["decoding_steps"]) == n
            # the numbers are results.jsonl's, per turn
            assert choice["new_tokens"] == rec["turn_new_tokens"] and sum(choice["new_tokens"]) == rec["stats"]["new_tokens"]
            assert sum(choice["decoding_steps"]) == rec["stats"]["verify_steps"]
            assert sum(choice["wall_time"]) == pytest.approx(rec["stats"]["seconds"])
            assert choice["turns"] == [t.strip() for t in rec["turn_texts"]]
            # accept_lengths: one entry per verify step, accepted drafts + 1
            assert len(choice["accept_lengths"]) == rec["stats"]["verify_steps"]
            assert sum(choice["accept_lengths"]) == rec["stats"]["verify_steps"] + rec["stats"]["accepted"]
            if method == "autoregressive":
                assert set(choice["accept_lengths"]) == {1}


def test_spec_bench_speed_reads_the_files(run_dir: Path):
    answers, results = run_dir / "model_answer", _read(run_dir / "results.jsonl")
    tokenizer = tiny_tokenizer()
    for task in TASKS:
        tps, tps_base, ratio, lengths = speed(answers / "selfspec.jsonl", answers / "autoregressive.jsonl", tokenizer, task)
        # the method's side is our own per-question tokens/s, averaged the way speed.py does
        picked = [r for r in results if r["method"] == "selfspec" and (
            task == "overall" or (task == "mt_bench" and r["category"] == "mt_bench") or r["category"] == task)]
        assert picked and tps == pytest.approx(np.mean([r["stats"]["new_tokens"] / sum(r["turn_seconds"]) for r in picked]))
        assert tps_base > 0 and ratio == pytest.approx(tps / tps_base) and np.isfinite(ratio)
        steps = sum(r["stats"]["verify_steps"] for r in picked)
        assert np.mean(lengths) == pytest.approx((steps + sum(r["stats"]["accepted"] for r in picked)) / steps)


def test_spec_bench_equal_reads_the_files(run_dir: Path, tmp_path: Path):
    answers = run_dir / "model_answer"
    txt = {}
    for name in ("autoregressive", "selfspec"):
        txt[name] = tmp_path / f"{name}.txt"
        get_content(answers / f"{name}.jsonl", txt[name])
    assert txt["selfspec"].read_text().count("\n") == len(QUESTIONS)
    assert txt_compare(txt["autoregressive"], txt["selfspec"])  # greedy selfspec is lossless: "Result totally Equal!"
    # and the comparison does see a difference: one changed turn in a copy of the answers
    changed = _read(answers / "selfspec.jsonl")
    changed[2]["choices"][0]["turns"][0] += " (changed)"
    (tmp_path / "changed.jsonl").write_text("".join(json.dumps(a) + "\n" for a in changed))
    get_content(tmp_path / "changed.jsonl", tmp_path / "changed.txt")
    assert not txt_compare(txt["autoregressive"], tmp_path / "changed.txt")


def test_accept_lengths_from_per_position_counts():
    # 5 verify steps: accepted 0, 1, 3, 3, 2 drafts (K = 3): per position, steps that accepted it: 4, 3, 2
    stats = {"verify_steps": 5, "accepted": 9, "accepted_per_position": [4, 3, 2]}
    assert sorted(accept_lengths(stats)) == sorted([1, 2, 4, 4, 3])
    assert accept_lengths({"verify_steps": 3, "accepted_per_position": []}) == [1, 1, 1]  # no drafts
