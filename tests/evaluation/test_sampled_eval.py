"""Sampled evaluation (decode.temperature > 0): our engine's methods sample with one seed per prompt's turn, shared
by every method; lossless is reported as not checked token for token (the distribution tests check sampling's
exactness), speedup / tau / acceptance as usual; HF's methods stay greedy and are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from selfspec.data import PromptItem
from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.errors import SelfSpecError
from selfspec.evaluation.report import SAMPLING_TESTS, summarize_methods, summary_markdown
from selfspec.evaluation.runner import Renderer, build_methods, check_methods, prompt_seed, run_eval

ITEMS = [PromptItem("a", "x", ("one two three one two three",)), PromptItem("b", "y", ("four five", "six seven"))]


def _run(m, names, decode, items=ITEMS):
    methods = build_methods(names, m, decode, head=m.head)
    records = run_eval(methods, items, Renderer(m.tokenizer, chat=False), decode.max_new_tokens, torch.device("cpu"),
                       warmup=False)
    return methods, records


def test_sampled_run_reports_lossless_as_not_checked() -> None:
    m = make_tiny("llama", head="lens", exit_layer=2)
    names = ["autoregressive", "selfspec", "selfspec+lookup:tree=dynamic:tree_nodes=4"]
    sample = DecodeConfig(draft_len=3, max_new_tokens=12, temperature=0.7, seed=3)
    methods, records = _run(m, names, sample)
    assert all(x.sampled and x.seed == 3 for x in methods)
    by = {(r["method"], r["prompt_id"]): r for r in records}
    for pid, turns in (("a", 1), ("b", 2)):
        seeds = [prompt_seed(3, pid, t) for t in range(turns)]
        assert all(by[(n, pid)]["sampled"] is True and by[(n, pid)]["seeds"] == seeds for n in names)
    assert prompt_seed(3, "a", 0) != prompt_seed(3, "b", 0) != prompt_seed(3, "b", 1)
    # the record's seed is the one the call used: the same decode, seeded so, gives the same tokens
    ids = Renderer(m.tokenizer, chat=False).render(ITEMS[0].turns, [])[0]
    again, _ = Decoder(m.backbone, None).generate(ids, DecodeConfig(strategy="autoregressive", max_new_tokens=12,
                                                                    temperature=0.7, seed=prompt_seed(3, "a", 0)),
                                                 m.eos_ids)
    assert again == by[("autoregressive", "a")]["token_ids"]
    greedy, _ = Decoder(m.backbone, None).generate(ids, DecodeConfig(strategy="autoregressive", max_new_tokens=12),
                                                   m.eos_ids)
    assert greedy != again  # it really sampled

    summary = summarize_methods(records, reference="autoregressive")
    assert summary["sampled"] is True
    for name, s in summary["methods"].items():
        assert s["sampled"] is True and s["lossless"] is None, name
        assert s["speedup"] > 0 and s["tau"] >= 1.0 and s["tokens_per_s"] > 0
    for name in names[1:]:
        s = summary["methods"][name]
        assert 0 <= s["accept_rate"] <= 1 and s["accept_rate_per_position"]
    assert all(c["lossless"] is None for per in summary["per_category"].values() for c in per.values())
    md = summary_markdown(summary)
    rows = [line for line in md.splitlines() if line.startswith("| `")][: len(names)]
    assert len(rows) == len(names) and all("n/a (sampled)" in row for row in rows)
    assert "not checked token for token" in md and SAMPLING_TESTS in md
    for path in SAMPLING_TESTS.split(", "):  # the note names test files that exist
        assert (Path(__file__).parents[2] / path).is_file(), path


def test_greedy_run_still_reports_lossless() -> None:
    m = make_tiny("llama", head="lens", exit_layer=2)
    methods, records = _run(m, ["autoregressive", "selfspec"], DecodeConfig(draft_len=3, max_new_tokens=10))
    assert not any(x.sampled for x in methods) and all(r["sampled"] is False and "seeds" not in r for r in records)
    summary = summarize_methods(records, reference="autoregressive")
    assert summary["sampled"] is False and summary["methods"]["selfspec"]["lossless"] == 1.0
    md = summary_markdown(summary)
    assert "| 100.0% |" in md and "n/a (sampled)" not in md and "not checked" not in md
    # one wrong token in a greedy record is caught: the comparison really runs
    bad = [dict(r, token_ids=[t + 1 for t in r["token_ids"]]) if r["method"] == "selfspec" and r["prompt_id"] == "a"
           else r for r in records]
    assert summarize_methods(bad, reference="autoregressive")["methods"]["selfspec"]["lossless"] == 0.5


def test_sampled_records_are_not_compared_even_if_the_reference_is_greedy() -> None:
    def rec(method, sampled):
        return {"method": method, "prompt_id": "p", "token_ids": [1, 2], "sampled": sampled,
                "stats": {"new_tokens": 2, "verify_steps": 2, "seconds": 1.0, "accepted": 0, "drafted": 0}}

    summary = summarize_methods([rec("ref", False), rec("s", True)], reference="ref")
    assert summary["methods"]["ref"]["lossless"] == 1.0 and summary["methods"]["s"]["lossless"] is None
    assert summary["methods"]["s"]["speedup"] == 1.0
    with pytest.raises(SelfSpecError, match=r"records\[0\].sampled must be true, false or absent"):
        summarize_methods([rec("ref", "yes")])


def test_hf_methods_are_refused_under_sampling() -> None:
    sample = DecodeConfig(temperature=0.7)
    for hf in ("hf_generate", "hf_early_exit", "hf_prompt_lookup"):
        with pytest.raises(SelfSpecError) as exc:
            check_methods(["autoregressive", hf, "selfspec"], sample)
        msg = str(exc.value)
        assert "\n" not in msg and msg.startswith("decode.temperature=0.7: methods " + hf + ": HF's methods decode "
                                                  "greedily") and "autoregressive, selfspec, lookup" in msg
    check_methods(["autoregressive", "selfspec", "lookup", "selfspec+lookup:tree=dynamic"], sample)


def test_unseeded_sampling_draws_one_seed_for_the_run() -> None:
    m = make_tiny("llama", head="lens", exit_layer=2)
    methods = build_methods(["autoregressive", "selfspec", "lookup"], m, DecodeConfig(temperature=0.7, seed=None),
                            head=m.head)
    seeds = {x.seed for x in methods}
    assert len(seeds) == 1 and None not in seeds


def test_decode_sample_composes_with_eval() -> None:
    from hydra import compose, initialize_config_dir

    from selfspec.cli.eval import decode_config_for_eval, eval_config
    from selfspec.utils.paths import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("eval", overrides=["decode=sample", "decode.temperature=0.7",
                                         'methods=[autoregressive,selfspec,"selfspec:draft_len=2"]'])
        default = compose("eval", overrides=["decode=sample"])
    decode = decode_config_for_eval(cfg.decode)
    assert decode.temperature == 0.7 and decode.top_p == 0.95 and decode.seed == 0
    check_methods(eval_config(cfg).methods, decode)
    # the default methods include HF's: refused with sampling
    with pytest.raises(SelfSpecError, match="^decode.temperature=0.8: methods hf_generate, hf_early_exit, "
                                            "hf_prompt_lookup: HF's methods decode greedily"):
        check_methods(eval_config(default).methods, decode_config_for_eval(default.decode))


def test_sampled_eval_app_with_variants(tmp_path: Path) -> None:
    """The whole app (~10 s): decode=sample with variants on the tiny model; summary.md says lossless is not
    checked; the default methods (with HF's) under sampling are one line and exit 2."""
    from test_eval import TINY, run_app

    out = tmp_path / "run"
    proc = run_app([*TINY, "head=lens", "head.exit_layer=2", "decode=sample", "decode.temperature=0.7",
                    "decode.max_new_tokens=8", "prompts.limit=1", "warmup=false",
                    'methods=[autoregressive,selfspec,"selfspec:tree=dynamic:tree_nodes=4"]', f"hydra.run.dir={out}"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == ["autoregressive", "selfspec", "selfspec:tree=dynamic:tree_nodes=4"]
    assert summary["sampled"] is True and all(m["lossless"] is None for m in summary["methods"].values())
    assert summary["run"]["sampled"]["temperature"] == 0.7
    assert summary["run"]["method_settings"]["selfspec:tree=dynamic:tree_nodes=4"] == {"tree": "dynamic", "tree_nodes": 4}
    md = (out / "summary.md").read_text()
    assert "n/a (sampled)" in md and "| `selfspec:tree=dynamic:tree_nodes=4` |" in md
    assert json.loads((out / "result.json").read_text())["eval/lossless"] is None
    proc = run_app([*TINY, "head=lens", "decode=sample", f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "HF's methods decode greedily" in lines[0], proc.stderr
