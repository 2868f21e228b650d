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
