"""selfspec.cli.sweep_summary: per-job results -> summary.md / summary.csv (with run_job_safely in a real multirun)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfspec.cli.sweep_summary import COLUMNS, SweepSummaryCallback, write_sweep_summary


def _make_job(sweep_dir: Path, name: str, overrides: list[str], result: dict | None) -> Path:
    job = sweep_dir / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))
    return job


@pytest.fixture
def fake_sweep(tmp_path: Path) -> Path:
    sweep = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")  # Hydra's own file: not a job
    ok = {
        "status": "ok",
        "head": "linear",
        "exit_layer": 6,
        "val/tau": 2.5,
        "val/accept_rate": 0.61,
        "val/speedup": 1.42,
        "head_params": 589824,
        "train_time_s": 12.3,
    }
    _make_job(sweep, "0", ["head=linear", "exit_layer=6"], ok)
    _make_job(sweep, "1", ["head=mlp", "exit_layer=4"], {"status": "failed", "error": "RuntimeError: CUDA OOM"})
    return sweep


def test_summary_rows_and_columns(fake_sweep: Path) -> None:
    md_path, csv_path = write_sweep_summary(fake_sweep)
    assert (md_path, csv_path) == (fake_sweep / "summary.md", fake_sweep / "summary.csv")

    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert COLUMNS[:10] == [
        "job", "overrides", "status", "head", "exit_layer", "tau", "accept_rate", "speedup", "params", "train_time_s",
    ]
    assert [r["job"] for r in rows] == ["0", "1"]
    ok, failed = rows
    assert ok["overrides"] == "head=linear exit_layer=6"
    assert ok["status"] == "ok"
    assert (ok["head"], ok["exit_layer"], ok["tau"], ok["accept_rate"]) == ("linear", "6", "2.5", "0.61")
    assert (ok["speedup"], ok["params"], ok["train_time_s"], ok["error"]) == ("1.42", "589824", "12.3", "")
    assert failed["overrides"] == "head=mlp exit_layer=4"
    assert failed["status"] == "failed"
    assert failed["error"] == "RuntimeError: CUDA OOM"
    assert all(failed[c] == "" for c in ("head", "tau", "accept_rate", "speedup", "params", "train_time_s"))

    md = md_path.read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(table) == 2 + 2  # header, separator, two jobs
    assert table[2].startswith("| 0 | head=linear exit_layer=6 | ok | linear | 6 | 2.5 |")
    assert "| 1 | head=mlp exit_layer=4 | failed |" in table[3]
    assert "RuntimeError: CUDA OOM" in table[3]
    assert "2 jobs, 1 ok, 1 failed." in md
    # Atomic writes leave no temp files behind.
    assert not list(fake_sweep.glob(".*.tmp"))


def test_job_without_result_and_numeric_order(fake_sweep: Path) -> None:
    for n in range(2, 11):
        _make_job(fake_sweep, str(n), [f"seed={n}"], {"val/tau": float(n)})
    _make_job(fake_sweep, "11", ["seed=11"], None)  # killed before it could write anything
    (fake_sweep / "12").mkdir()
    (fake_sweep / "12" / "result.json").write_text("{not json")

    _, csv_path = write_sweep_summary(fake_sweep)
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == [str(n) for n in range(13)]  # "10" after "9", not after "1"
    assert rows[5]["status"] == "ok" and rows[5]["tau"] == "5.0"  # no status key -> ok
    assert rows[11]["status"] == "failed" and "no result.json" in rows[11]["error"]
    assert rows[12]["status"] == "failed" and "unreadable result.json" in rows[12]["error"]


def test_callback_uses_sweep_dir(fake_sweep: Path) -> None:
    config = SimpleNamespace(hydra=SimpleNamespace(sweep=SimpleNamespace(dir=str(fake_sweep))))
    SweepSummaryCallback().on_multirun_end(config=config)
    assert (fake_sweep / "summary.md").is_file() and (fake_sweep / "summary.csv").is_file()


def test_real_hydra_multirun(tmp_path: Path) -> None:
    """End to end: a failing job does not stop the sweep, and the callback summarizes both jobs."""
    (tmp_path / "config.yaml").write_text(
        textwrap.dedent(
            """
            x: 1
            hydra:
              sweep:
                dir: sweep
              callbacks:
                sweep_summary:
                  _target_: selfspec.cli.sweep_summary.SweepSummaryCallback
            """
        )
    )
    (tmp_path / "app.py").write_text(
        textwrap.dedent(
            """
            import json
            import hydra
            from hydra.core.hydra_config import HydraConfig
            from selfspec.cli.hydra_utils import run_job_safely

            def job(cfg):
                if cfg.x == 2:
                    raise RuntimeError("x=2 is bad")
                out = HydraConfig.get().runtime.output_dir + "/result.json"
                with open(out, "w") as f:
                    json.dump({"status": "ok", "val/tau": 3.0}, f)
                return 3.0

            @hydra.main(version_base=None, config_path=".", config_name="config")
            def main(cfg):
                return run_job_safely(job, cfg)

            if __name__ == "__main__":
                main()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "sweep" / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["overrides"], r["status"], r["tau"]) for r in rows] == [
        ("0", "x=1", "ok", "3.0"),
        ("1", "x=2", "failed", ""),
    ]
    assert rows[1]["error"] == "RuntimeError: x=2 is bad"
