"""selfspec.utils.logger: offline-by-default mode, a real offline W&B run, finish-on-error, and config validation.

Each wandb.init costs a few seconds, so only two tests start a real run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.errors import SelfSpecError
from selfspec.utils.logger import Logger, LoggerConfig, WandbLogger, logging_run, make_logger, resolve_wandb_mode


@pytest.fixture
def clean_wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No credentials, no mode, and a fresh HOME: what a new machine looks like. Returns the fake HOME."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    # Keep wandb's settings/cache/artifact dirs out of the real home too.
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / ".local" / "share" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home


def _offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def _tiny_png(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1), dpi=20)
    ax.plot([0, 1], [0, 1])
    fig.savefig(path)
    plt.close(fig)
    return path


def test_mode_is_offline_without_credentials(clean_wandb_env: Path) -> None:
    assert resolve_wandb_mode(LoggerConfig()) == "offline"


def test_mode_precedence(clean_wandb_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A `wandb login` (netrc entry) means the user wants online runs.
    (clean_wandb_env / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    assert resolve_wandb_mode(LoggerConfig()) == "online"
    # $WANDB_MODE beats the credentials ...
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode(LoggerConfig()) == "offline"
    # ... and an explicit logger.mode beats both.
    assert resolve_wandb_mode(LoggerConfig(mode="disabled")) == "disabled"


def test_api_key_env_means_online(clean_wandb_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode(LoggerConfig()) == "online"


def test_netrc_for_other_host_is_ignored(clean_wandb_env: Path) -> None:
    (clean_wandb_env / ".netrc").write_text("machine example.com login u password p\n")
    assert resolve_wandb_mode(LoggerConfig()) == "offline"


def test_wandb_offline_run_logs_and_finishes(tmp_path: Path, clean_wandb_env: Path) -> None:
    run_dir = tmp_path / "run"
    png = _tiny_png(tmp_path / "plot.png")
    cfg = LoggerConfig(group="test", tags=["unit"], name="logs-everything")
    logger = make_logger(cfg, run_dir, config={"lr": 1e-3, "head": "linear"})
    assert isinstance(logger, WandbLogger)
    assert logger.mode == "offline"
    for step in range(3):
        logger.log({"train/loss": 1.0 / (step + 1), "train/lr": 1e-3}, step=step)
    logger.log_table("val/per_prompt", ["prompt", "tau"], [["a", 2.5], ["b", 3.0]])
    logger.log_image("val/plot", png)
    logger.summary({"val/tau": 2.75})
    logger.finish()
    logger.finish()  # a second finish is a no-op, not an error

    runs = _offline_runs(run_dir)
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    assert list(runs[0].glob("*.wandb")), list(runs[0].iterdir())


def test_logging_run_finishes_on_error_and_reraises(tmp_path: Path, clean_wandb_env: Path) -> None:
    import wandb

    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"):
        with logging_run(LoggerConfig(), run_dir, config={}) as logger:
            logger.log({"train/loss": 1.0}, step=0)
            raise RuntimeError("boom")
    # finish() ran: no run is left open in this process.
    assert wandb.run is None
    runs = _offline_runs(run_dir)
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))


def test_kind_none_is_a_noop(tmp_path: Path, clean_wandb_env: Path) -> None:
    run_dir = tmp_path / "run"
    with logging_run(LoggerConfig(kind="none"), run_dir, config={"a": 1}) as logger:
        assert type(logger) is Logger
        logger.log({"train/loss": 1.0}, step=0)
        logger.log_table("t", ["a"], [[1]])
        logger.log_image("i", tmp_path / "missing.png")
        logger.summary({"val/tau": 1.0})
    assert not (run_dir / "wandb").exists()


def test_bad_kind_names_the_parameter() -> None:
    with pytest.raises(SelfSpecError, match=r"logger\.kind.*wandb, none"):
        LoggerConfig(kind="tensorboard")


def test_bad_mode_names_the_parameter() -> None:
    with pytest.raises(SelfSpecError, match=r"logger\.mode.*online, offline"):
        LoggerConfig(mode="sometimes")
