"""One table for a whole Hydra sweep: `summary.md` and `summary.csv` in the sweep dir, one row per job.

Each job writes `result.json` into its own run dir (`selfspec.cli.hydra_utils.run_job_safely` writes a failed one
when the job raises). `SweepSummaryCallback` collects them when the multirun ends; enable it with

    hydra:
      callbacks:
        sweep_summary:
          _target_: selfspec.cli.sweep_summary.SweepSummaryCallback

The core is the plain function `write_sweep_summary`, so it also works on an old sweep dir by hand.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from selfspec.utils.io import atomic_write_text
from selfspec.utils.markdown import table
from selfspec.utils.sweeps import RESULT_FILE, find_job_dirs

log = logging.getLogger(__name__)

SUMMARY_MD = "summary.md"
SUMMARY_CSV = "summary.csv"

# Summary column -> result.json key. The first three columns come from the job dir, not from the metrics.
METRIC_COLUMNS: dict[str, str] = {
    "head": "head",
    "exit_layer": "exit_layer",
    "tau": "val/tau",
    "accept_rate": "val/accept_rate",
    "speedup": "val/speedup",
    "params": "head_params",
    "train_time_s": "train_time_s",
}
# `error` comes last: it is empty for a good job and long for a failed one, so it must not push the metrics
# off the side of the table.
COLUMNS: list[str] = ["job", "overrides", "status", *METRIC_COLUMNS, "error"]


def _read_overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    try:
        overrides = yaml.safe_load(path.read_text()) or []
    except (yaml.YAMLError, OSError) as exc:
        log.warning("unreadable %s: %s", path, exc)
        return ""
    return " ".join(str(o) for o in overrides)


def _job_row(sweep_dir: Path, job_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row["job"] = job_dir.relative_to(sweep_dir).as_posix()
    row["overrides"] = _read_overrides(job_dir)
    result_path = job_dir / RESULT_FILE
    if not result_path.is_file():
        # No result at all: the process died (OOM, kill, timeout) before run_job_safely could record anything.
        row["status"] = "failed"
        row["error"] = f"no {RESULT_FILE} (job crashed, was killed or is still running)"
        return row
    try:
        result = json.loads(result_path.read_text())
        if not isinstance(result, dict):
            raise ValueError(f"expected a JSON object, got {type(result).__name__}")
    except (ValueError, OSError) as exc:
        row["status"] = "failed"
        row["error"] = f"unreadable {RESULT_FILE}: {exc}"
        return row
    # A result.json written by a finished job need not carry a status; only failed ones must.
    row["status"] = str(result.get("status", "ok"))
    row["error"] = str(result.get("error", "") or "")
    for column, key in METRIC_COLUMNS.items():
        value = result.get(key)
        row[column] = "" if value is None else value
    return row


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row (column -> value, "" when missing) per job dir under sweep_dir."""
    sweep_dir = Path(sweep_dir)
    return [_job_row(sweep_dir, job_dir) for job_dir in find_job_dirs(sweep_dir)]


def _format_md_cell(value: Any) -> str:
    # The CSV keeps full precision; the markdown table is for reading.
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def render_markdown(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    n_failed = sum(1 for r in rows if r["status"] != "ok")
    lines = [
        f"# Sweep summary: {Path(sweep_dir).name}",
        "",
        f"{len(rows)} jobs, {len(rows) - n_failed} ok, {n_failed} failed.",
        "",
    ]
    lines += table(COLUMNS, [[_format_md_cell(r[c]) for c in COLUMNS] for r in rows])
    return "\n".join(lines) + "\n"


def render_csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_sweep_summary(sweep_dir: Path) -> tuple[Path, Path]:
    """Write summary.md and summary.csv into sweep_dir; return (md_path, csv_path)."""
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir)
    md_path, csv_path = sweep_dir / SUMMARY_MD, sweep_dir / SUMMARY_CSV
    # Atomic writes (selfspec.utils.io): a reader never sees a half-written summary.
    atomic_write_text(md_path, render_markdown(sweep_dir, rows))
    atomic_write_text(csv_path, render_csv(rows))
    return md_path, csv_path


class SweepSummaryCallback(Callback):
    """Hydra callback: after the last job of a multirun, write the sweep summary."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            # Nothing ran (for example every job was rejected before launch): nothing to summarize.
            log.warning("sweep dir %s does not exist; no summary written", sweep_dir)
            return
        md_path, csv_path = write_sweep_summary(sweep_dir)
        log.info("sweep summary: %s, %s", md_path, csv_path)
