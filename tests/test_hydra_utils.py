"""selfspec.cli.hydra_utils: one failing sweep job does not stop the others; user errors are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.types import RunMode

from selfspec.cli import hydra_utils


def _fake_hydra(monkeypatch: pytest.MonkeyPatch, output_dir: Path, mode: RunMode) -> None:
    hydra_cfg = SimpleNamespace(mode=mode, runtime=SimpleNamespace(output_dir=str(output_dir)))
    monkeypatch.setattr(hydra_utils.HydraConfig, "get", staticmethod(lambda: hydra_cfg))


def _boom(cfg: object) -> float:
    raise ValueError("bad head")


def test_run_job_safely_multirun_records_and_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hydra(monkeypatch, tmp_path, RunMode.MULTIRUN)
    assert hydra_utils.run_job_safely(_boom, cfg=None) is None
    assert json.loads((tmp_path / "result.json").read_text()) == {"status": "failed", "error": "ValueError: bad head"}
    assert hydra_utils.run_job_safely(lambda cfg: 0.5, cfg=None) == 0.5


def test_run_job_safely_single_run_reraises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hydra(monkeypatch, tmp_path, RunMode.RUN)
    with pytest.raises(ValueError, match="bad head"):
        hydra_utils.run_job_safely(_boom, cfg=None)
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_print_user_error_and_exit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        hydra_utils.print_user_error_and_exit(ValueError("logger.kind='x' is not supported"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: logger.kind='x' is not supported\n"
