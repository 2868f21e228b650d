"""selfspec.evaluation.report: the analytic speedup model, per-method summaries, markdown, the (E, K) sweep report."""

import math

import pytest

from evaluation.samples import rec, records, sweep_rows
from selfspec.errors import SelfSpecError
from selfspec.evaluation.report import (
    aggregate_sweep,
    alpha_from_accept_rate_per_position,
    cost_ratios,
    expected_tau,
    predicted_speedup,
    summarize_methods,
    summary_markdown,
    sweep_grid,
)


# ---------------------------------------------------------------------------------------------------------------
# Analytic model
# ---------------------------------------------------------------------------------------------------------------


def test_expected_tau_and_predicted_speedup_hand_values():
    assert expected_tau(0.5, 3) == pytest.approx(1.875)  # 1 + .5 + .25 + .125
    assert predicted_speedup(0.5, 3, 0.25, 1.0) == pytest.approx(1.875 / 1.75)
    assert predicted_speedup(0.5, 3, 0.25) == pytest.approx(1.875 / 1.75)  # verify_cost defaults to 1
    assert predicted_speedup(0.8, 4, 0.1, 1.2) == pytest.approx((1 - 0.8**5) / 0.2 / (0.4 + 1.2))
    assert expected_tau(0.0, 5) == 1.0
    assert expected_tau(0.3, 0) == 1.0
    assert predicted_speedup(0.3, 0, 0.5, 1.0) == 1.0  # K=0: plain decoding


def test_alpha_one_limit():
    assert expected_tau(1.0, 4) == 5.0
    assert predicted_speedup(1.0, 4, 0.25, 1.0) == pytest.approx(5.0 / 2.0)
    # Continuous at the limit.
    assert expected_tau(1.0 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)


@pytest.mark.parametrize(
    "args",
    [(-0.1, 3, 0.25), (1.1, 3, 0.25), (float("nan"), 3, 0.25), (0.5, -1, 0.25), (0.5, 2.5, 0.25),
     (0.5, 3, 0.0), (0.5, 3, -1.0), (0.5, 3, 0.25, 0.0), (0.5, 3, 0.25, -2.0), ("0.5", 3, 0.25)],
)
def test_predicted_speedup_rejects_bad_inputs(args):
    with pytest.raises(SelfSpecError):
        predicted_speedup(*args)


def test_alpha_from_per_position_rates():
    assert alpha_from_accept_rate_per_position([0.9, 0.7, None, float("nan"), 0.5]) == pytest.approx(0.7)
    with pytest.raises(SelfSpecError):
        alpha_from_accept_rate_per_position([None, float("nan")])
    with pytest.raises(SelfSpecError):
        alpha_from_accept_rate_per_position([])
    with pytest.raises(SelfSpecError):
        alpha_from_accept_rate_per_position([0.5, 1.5])


def test_summarize_methods_numbers():
    s = summarize_methods(records())
    ref, ss = s["methods"]["hf_generate"], s["methods"]["selfspec"]

    assert ref["tokens_per_s"] == pytest.approx(10.0)  # 30 tokens / 3 s
    assert ref["speedup"] == pytest.approx(1.0)
    assert ref["tau"] == pytest.approx(1.0)
    assert ref["accept_rate"] is None  # never drafted
    assert ref["accept_rate_per_position"] == []
    assert ref["lossless"] == 1.0
    assert ref["head_params"] is None
    assert ref["peak_memory_mb"] == 1100.0

    assert ss["tokens_per_s"] == pytest.approx(30.0)  # 30 tokens / 1 s
    assert ss["speedup"] == pytest.approx(3.0)
    assert ss["tau"] == pytest.approx(3.0)  # 30 / 10 verify steps
    assert ss["accept_rate"] == pytest.approx(20 / 27)
    assert ss["accept_rate_per_position"] == pytest.approx([9 / 10, 7 / 9, 4 / 8])
    assert ss["lossless"] == 0.5
    assert ss["peak_memory_mb"] == 1250.0
    assert ss["head_params"] == 2_500_000
    assert ss["prompts"] == 2 and ss["new_tokens"] == 30

    code, chat = s["per_category"]["code"]["selfspec"], s["per_category"]["chat"]["selfspec"]
    assert code["tokens_per_s"] == pytest.approx(20.0)
    assert code["speedup"] == pytest.approx(2.0)
    assert code["tau"] == pytest.approx(2.5)
    assert code["accept_rate"] == pytest.approx(6 / 9)
    assert code["lossless"] == 1.0
    assert chat["speedup"] == pytest.approx(4.0)
    assert chat["tau"] == pytest.approx(20 / 6)
    assert chat["lossless"] == 0.0
    assert s["per_category"]["chat"]["hf_generate"]["speedup"] == pytest.approx(1.0)


def test_summarize_without_reference_and_custom_reference():
    recs = [r for r in records() if r["method"] != "hf_generate"]
    ss = summarize_methods(recs)["methods"]["selfspec"]
    assert ss["speedup"] is None and ss["lossless"] is None
    assert ss["tokens_per_s"] == pytest.approx(30.0)

    s = summarize_methods(records(), reference="selfspec")
    assert s["methods"]["hf_generate"]["speedup"] == pytest.approx(1 / 3)


def test_summarize_speedup_uses_shared_prompts_only():
    # The reference ran only p1: speedup and lossless compare on p1 alone.
    recs = [r for r in records() if not (r["method"] == "hf_generate" and r["prompt_id"] == "p2")]
    ss = summarize_methods(recs)["methods"]["selfspec"]
    assert ss["speedup"] == pytest.approx(20.0 / 10.0)
    assert ss["lossless"] == 1.0
    assert ss["tokens_per_s"] == pytest.approx(30.0)  # own throughput still over all its prompts


def test_summarize_merges_multi_turn_records():
    whole = [rec("hf_generate", "m", "multi", [1, 2, 3, 4], 4, 4, 2.0),
             rec("selfspec", "m", "multi", [1, 2, 3, 4], 4, 2, 0.5, 2, 4, [2, 2], [1, 1])]
    turns = [rec("hf_generate", "m", "multi", [1, 2], 2, 2, 1.0),
             rec("hf_generate", "m", "multi", [3, 4], 2, 2, 1.0),
             rec("selfspec", "m", "multi", [1, 2], 2, 1, 0.25, 1, 2, [1, 1], [1, 0]),
             rec("selfspec", "m", "multi", [3, 4], 2, 1, 0.25, 1, 2, [1, 1], [0, 1])]
    a, b = summarize_methods(whole), summarize_methods(turns)
    assert a["methods"] == b["methods"]
    assert b["methods"]["selfspec"]["lossless"] == 1.0
    assert b["methods"]["selfspec"]["prompts"] == 1
    assert b["methods"]["selfspec"]["speedup"] == pytest.approx(4.0)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.pop("method"),
        lambda r: r.pop("stats"),
        lambda r: r["stats"].pop("seconds"),
        lambda r: r["stats"].update(seconds=-1.0),
        lambda r: r["stats"].update(accepted=99),
        lambda r: r["stats"].update(accepted_per_position=[5, 0, 0]),
        lambda r: r.update(token_ids="abc"),
    ],
)
def test_summarize_rejects_bad_records(mutate):
    recs = records()
    mutate(recs[2])
    with pytest.raises(SelfSpecError):
        summarize_methods(recs)
    with pytest.raises(SelfSpecError):
        summarize_methods("not a list")


def test_summary_markdown_lists_methods_and_sections():
    md = summary_markdown(summarize_methods(records()))
    for name in ("hf_generate", "selfspec"):
        assert name in md
    assert "3.00x" in md and "50.0%" in md and "2.50M" in md
    assert "Speedup by category" in md and "| code |" in md and "| chat |" in md
    assert "Acceptance by draft position" in md and "90.0%" in md
    # Missing values print as "-" (reference never drafted).
    hf_row = next(line for line in md.splitlines() if line.startswith("| `hf_generate`"))
    assert "| - |" in hf_row
    with pytest.raises(SelfSpecError):
        summary_markdown({"no": "methods"})



# ---------------------------------------------------------------------------------------------------------------
# (E, K) sweeps
# ---------------------------------------------------------------------------------------------------------------


def test_aggregate_sweep_markdown_and_grid():
    rows = sweep_rows()
    md, grid = aggregate_sweep(rows)
    assert "E=8, K=4" in md and "2.50x" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == 9
    assert table[0].startswith("| 8 | 4 |")  # sorted best first
    speeds = [float(line.split("|")[5].strip().rstrip("x")) for line in table]  # E, K, precision, head, speedup
    assert speeds == sorted(speeds, reverse=True)
    assert grid["exit_layers"] == [4, 8, 12] and grid["draft_lens"] == [2, 4, 6]
    assert grid["speedup"][1][1] == 2.5
    assert grid["tau"][0][0] == pytest.approx(expected_tau(0.46, 2))


def test_sweep_grid_missing_cells_and_duplicate_heads():
    rows = [{"exit_layer": 4, "draft_len": 2, "head": "a", "tau": 2.0, "accept_rate": 0.5, "speedup": 1.2,
             "predicted_speedup": None},
            {"exit_layer": 4, "draft_len": 2, "head": "b", "tau": 2.2, "accept_rate": 0.6, "speedup": 1.4,
             "predicted_speedup": 1.5},
            {"exit_layer": 8, "draft_len": 3, "head": "a", "tau": None, "accept_rate": None, "speedup": None,
             "predicted_speedup": None}]
    grid = sweep_grid(rows)
    assert grid["head"][0][0] == "b" and grid["speedup"][0][0] == 1.4
    assert grid["speedup"][0][1] is None and grid["speedup"][1][0] is None and grid["speedup"][1][1] is None
    md, _ = aggregate_sweep(rows)
    assert "E=4, K=2" in md
    assert md.strip().splitlines()[-1].startswith("| 8 | 3 |")  # failed job sorted last


def test_nan_free_numbers():
    # Guard: a method that ran zero seconds gets None rather than inf/NaN.
    s = summarize_methods([rec("hf_generate", "p", "c", [1], 1, 1, 0.0)])
    m = s["methods"]["hf_generate"]
    assert m["tokens_per_s"] is None and m["speedup"] is None
    assert all(not (isinstance(v, float) and math.isnan(v)) for v in m.values() if not isinstance(v, list))


def test_cost_ratios_from_engine_stats() -> None:
    records = [
        {"method": "autoregressive", "stats": {"verify_s": 1.0, "verify_steps": 10, "seconds": 1.0}},
        {"method": "selfspec", "stats": {"draft_s": 0.2, "drafted": 8, "verify_s": 0.6, "verify_steps": 4}},
    ]
    c = cost_ratios(records)
    assert c["draft_cost"] == pytest.approx(0.25) and c["verify_cost"] == pytest.approx(1.5)
    assert cost_ratios(records[:1]) is None
    # with dynamic K the head also runs for drafts it then declines: c is per exit-head pass
    records[1]["stats"]["draft_steps"] = 10
    assert cost_ratios(records)["draft_cost"] == pytest.approx(0.2)
