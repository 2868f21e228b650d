"""selfspec.evaluation.plots: the summary PNGs, E x K heatmaps and the sweep report files."""

import pytest

from evaluation.samples import assert_png, records, sweep_rows
from selfspec.errors import SelfSpecError
from selfspec.evaluation.plots import (
    plot_acceptance_by_position,
    plot_heatmap,
    plot_speedup_by_category,
    write_sweep_report,
)
from selfspec.evaluation.report import aggregate_sweep, summarize_methods


def test_summary_plots_write_pngs(tmp_path):
    s = summarize_methods(records())
    assert_png(plot_acceptance_by_position(s, tmp_path / "acc.png"))
    assert_png(plot_speedup_by_category(s, tmp_path / "cat.png"))


def test_summary_plots_handle_missing_values(tmp_path):
    # No reference and no drafting: both plots still produce a (mostly empty) figure instead of failing.
    s = summarize_methods([r for r in records() if r["method"] == "hf_generate"], reference="absent")
    assert_png(plot_acceptance_by_position(s, tmp_path / "acc.png"))
    assert_png(plot_speedup_by_category(s, tmp_path / "cat.png"))
    s["methods"]["x"] = {"accept_rate_per_position": [0.8, None, 0.5]}
    assert_png(plot_acceptance_by_position(s, tmp_path / "sub" / "acc2.png"))


def test_write_sweep_report(tmp_path):
    out = tmp_path / "sweep"
    paths = write_sweep_report(out, sweep_rows())
    assert set(paths) == {"sweep.md", "heatmap_speedup.png", "heatmap_tau.png"}
    assert all(p.parent == out and p.exists() for p in paths.values())
    assert "Best: E=8, K=4" in paths["sweep.md"].read_text()
    assert_png(paths["heatmap_speedup.png"])
    assert_png(paths["heatmap_tau.png"])


def test_heatmap_with_missing_values_and_bad_key(tmp_path):
    rows = sweep_rows()
    rows[0]["speedup"] = None
    rows[1]["predicted_speedup"] = None
    rows.pop()  # a combination the sweep never ran
    assert_png(plot_heatmap(rows, "speedup", tmp_path / "h.png", title="custom"))
    assert_png(plot_heatmap(rows, "accept_rate", tmp_path / "a.png"))
    with pytest.raises(SelfSpecError):
        plot_heatmap(rows, "nope", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "rows",
    [[], [{"exit_layer": -1, "draft_len": 2, "speedup": 1.0}], [{"exit_layer": 2, "draft_len": "3"}],
     [{"exit_layer": 2, "draft_len": 3, "speedup": "fast"}], ["row"]],
)
def test_sweep_rejects_bad_rows(rows, tmp_path):
    with pytest.raises(SelfSpecError):
        aggregate_sweep(rows)
    with pytest.raises(SelfSpecError):
        write_sweep_report(tmp_path / "s", rows)
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_conditional_rates_divide_by_the_previous_share():
    from selfspec.evaluation.plots import conditional_rates

    assert conditional_rates([0.5, 0.25, 0.2, None, 0.1]) == [0.5, 0.5, 0.8, None, None]
    assert conditional_rates([0.0, 0.0]) == [0.0, None]
