"""Exit-layer x draft-length (x draft precision) sweep report: sweep.md and heatmap_{speedup,tau}.png in the sweep
dir, and heatmap_{speedup,tau}_<precision>.png per precision when the sweep ran several (head.draft_precision).

Each `python -m selfspec.eval -m ...` job writes result.json (`eval/speedup`, `eval/tau`, ..., exit_layer,
draft_len, head). `EvalSweepCallback` (registered in conf/eval.yaml) collects them when the multirun ends and
hands them to `plots.write_sweep_report`; `write_eval_sweep(dir)` does the same by hand for an old sweep dir.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from selfspec.evaluation.plots import write_sweep_report
from selfspec.utils.sweeps import RESULT_FILE, find_job_dirs
from selfspec.utils.io import atomic_write_text

log = logging.getLogger(__name__)


def sweep_rows(sweep_dir: Path) -> tuple[list[dict], list[dict]]:
    """-> (rows for report.aggregate_sweep, failed jobs as {"job", "error"})."""
    sweep_dir = Path(sweep_dir)
    rows, failed = [], []
    for job in find_job_dirs(sweep_dir):
        name = job.relative_to(sweep_dir).as_posix()
        path = job / RESULT_FILE
        try:
            res = json.loads(path.read_text()) if path.is_file() else {"status": "failed", "error": f"no {RESULT_FILE}"}
        except (OSError, ValueError) as exc:
            res = {"status": "failed", "error": f"unreadable {RESULT_FILE}: {exc}"}
        if res.get("status", "ok") != "ok":
            failed.append({"job": name, "error": str(res.get("error", ""))})
            continue
        if not isinstance(res.get("exit_layer"), int) or not isinstance(res.get("draft_len"), int):
            failed.append({"job": name, "error": "no selfspec exit_layer / draft_len in result.json"})
            continue
        rows.append({
            "job": name,
            "exit_layer": res["exit_layer"],
            "draft_precision": res.get("draft_precision") or "full",
            "draft_len": res["draft_len"],
            "head": f"{res.get('head')}" + (f" ({res['head_source']})" if res.get("head_source") else ""),
            "speedup": res.get("eval/speedup"),
            "predicted_speedup": res.get("eval/predicted_speedup"),
            "tau": res.get("eval/tau"),
            "accept_rate": res.get("eval/accept_rate"),
        })
    return rows, failed


def write_eval_sweep(sweep_dir: Path) -> dict[str, Path]:
    """Write sweep.md + heatmaps for the jobs under sweep_dir; failed jobs are listed under the table."""
    sweep_dir = Path(sweep_dir)
    rows, failed = sweep_rows(sweep_dir)
    if not rows:
        text = "# Exit-layer x draft-length sweep\n\nNo job finished.\n" + _failed_md(failed)
        return {"sweep.md": atomic_write_text(sweep_dir / "sweep.md", text)}
    return write_sweep_report(sweep_dir, rows, more_markdown=_failed_md(failed))


def _failed_md(failed: list[dict]) -> str:
    if not failed:
        return ""
    lines = ["", "## Failed jobs", ""] + [f"- `{f['job']}`: {f['error'].splitlines()[0] if f['error'] else '-'}"
                                          for f in failed]
    return "\n".join(lines) + "\n"


class EvalSweepCallback(Callback):
    """Hydra callback: after the last job of an eval multirun, write the E x K sweep report."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            log.warning("sweep dir %s does not exist; no sweep report written", sweep_dir)
            return
        try:
            paths = write_eval_sweep(sweep_dir)
        except Exception as exc:  # the jobs' own results are on disk; a report failure must not hide them
            log.error("could not write the sweep report in %s: %s", sweep_dir, exc, exc_info=True)
            return
        log.info("sweep report: %s", ", ".join(str(p) for p in paths.values()))
