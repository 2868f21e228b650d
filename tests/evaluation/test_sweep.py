"""selfspec.evaluation.sweep: the E x K report of an eval multirun (sweep.md, heatmaps, failed jobs)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from evaluation.samples import assert_png


def _fake_job(sweep: Path, name: str, result: dict | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))


def test_sweep_report_on_fake_multirun(tmp_path: Path) -> None:
    from selfspec.evaluation.sweep import EvalSweepCallback

    sweep = tmp_path / "multirun"
    n = 0
    for E in (2, 4):
        for K in (1, 2, 4):
            s = 0.8 + 0.1 * K - 0.05 * E
            _fake_job(sweep, str(n), {"status": "ok", "head": "lens", "head_source": "untrained", "exit_layer": E,
                                      "draft_len": K, "eval/speedup": s, "eval/predicted_speedup": s * 1.1,
                                      "eval/tau": 1 + K * 0.3, "eval/accept_rate": 0.5})
            n += 1
    _fake_job(sweep, str(n), {"status": "failed", "error": "RuntimeError: boom"})
    _fake_job(sweep, str(n + 1), None)  # killed before writing anything
    config = SimpleNamespace(hydra=SimpleNamespace(sweep=SimpleNamespace(dir=str(sweep))))
    EvalSweepCallback().on_multirun_end(config)
    md = (sweep / "sweep.md").read_text()
    assert "**Best: E=2, K=4**" in md and "predicted" in md
    assert md.count("| 2 | 4 |") == 1 and md.count("| `lens (untrained)` |") == 6
    assert "## Failed jobs" in md and "RuntimeError: boom" in md and "no result.json" in md
    assert_png(sweep / "heatmap_speedup.png")
    assert_png(sweep / "heatmap_tau.png")


def test_precision_sweep_writes_a_map_per_precision(tmp_path: Path) -> None:
    """E x K x head.draft_precision: the table names each row's precision and each precision gets its own maps."""
    from selfspec.evaluation.sweep import write_eval_sweep

    sweep = tmp_path / "multirun"
    n = 0
    for precision, bonus in (("full", 0.0), ("int8", 0.4)):
        for E in (6, 30):
            for K in (2, 4):
                _fake_job(sweep, str(n), {"status": "ok", "head": "lens", "exit_layer": E, "draft_len": K,
                                          "draft_precision": precision, "eval/speedup": 0.7 + bonus + 0.01 * E,
                                          "eval/tau": 1.5, "eval/accept_rate": 0.4})
                n += 1
    paths = write_eval_sweep(sweep)
    md = (sweep / "sweep.md").read_text()
    assert "**Best: E=30, K=2, int8**" in md or "**Best: E=30, K=4, int8**" in md
    assert md.count("| int8 |") == 4 and md.count("| full |") == 4
    for name in ("heatmap_speedup_full.png", "heatmap_speedup_int8.png", "heatmap_tau_int8.png"):
        assert name in paths
        assert_png(sweep / name)
