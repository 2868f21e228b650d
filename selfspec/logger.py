"""Experiment logging behind one small interface, so that training and evaluation code never does I/O itself.

`make_logger` returns a `WandbLogger` or a no-op `Logger`; the algorithm only ever calls `log`, `log_table`,
`log_image`, `summary` and `finish`. W&B runs offline unless the user has asked for, or has set up, online use:
a research run on a machine without credentials must neither prompt for a login nor try the network.
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from selfspec.errors import SelfSpecError

log = logging.getLogger(__name__)

LOGGER_KINDS = ("wandb", "none")
# "disabled" is W&B's own no-op mode; it is accepted so that `WANDB_MODE=disabled` keeps its usual meaning.
WANDB_MODES = ("online", "offline", "disabled")
_DEFAULT_WANDB_HOST = "api.wandb.ai"


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # "wandb" | "none"
    project: str = "selfspec"
    group: str | None = None
    mode: str | None = None  # None = offline unless the user configured online (see resolve_wandb_mode)
    tags: list[str] = field(default_factory=list)
    name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOGGER_KINDS:
            raise SelfSpecError(f"logger.kind={self.kind!r} is not supported; allowed: {', '.join(LOGGER_KINDS)}")
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise SelfSpecError(
                f"logger.mode={self.mode!r} is not supported; allowed: {', '.join(WANDB_MODES)} (or null for auto)"
            )
        # Hydra hands over a ListConfig; wandb wants a plain sequence of str.
        self.tags = [str(t) for t in self.tags]


def _wandb_host() -> str:
    """The host whose credentials count: WANDB_BASE_URL's host for a self-hosted server, else api.wandb.ai."""
    base_url = os.environ.get("WANDB_BASE_URL")
    if base_url:
        host = urlparse(base_url).hostname
        if host:
            return host
    return _DEFAULT_WANDB_HOST


def _netrc_has_wandb_key() -> bool:
    """True when ~/.netrc (or $NETRC) has a password for the W&B host, which is where `wandb login` puts it."""
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    if not os.path.isfile(path):
        return False
    try:
        entry = netrc.netrc(path).authenticators(_wandb_host())
    except (netrc.NetrcParseError, OSError) as exc:
        # A broken netrc is the user's business; here it only means "no usable key", hence offline.
        log.debug("ignoring unreadable netrc %s: %s", path, exc)
        return False
    return bool(entry and entry[2])


def resolve_wandb_mode(cfg: LoggerConfig) -> str:
    """cfg.mode if set; else $WANDB_MODE; else "online" when an API key is configured; else "offline"."""
    if cfg.mode is not None:
        return cfg.mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        return env_mode
    if os.environ.get("WANDB_API_KEY") or _netrc_has_wandb_key():
        return "online"
    return "offline"


class Logger:
    """The no-op logger (logger.kind=none); also the interface that WandbLogger implements."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record scalar metrics; keys keep their slashes (`train/loss`, `val/tau`) so W&B groups them."""

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """Record a table under `key`, one list per row in `columns` order."""

    def log_image(self, key: str, path: str | os.PathLike[str]) -> None:
        """Record the image file at `path` (a plot saved by the caller) under `key`."""

    def summary(self, metrics: dict[str, Any]) -> None:
        """Set final values in the run summary (what a run table shows), overriding the last logged ones."""

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; exit_code != 0 marks it failed. Safe to call more than once."""


class WandbLogger(Logger):
    """A W&B run; offline runs land in `run_dir/wandb/offline-run-*` and can be pushed later with `wandb sync`."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> None:
        # Imported here so that `kind=none` (and every test that does not log) never pays wandb's import time.
        import wandb

        self._wandb = wandb
        self.mode = resolve_wandb_mode(cfg)
        run_dir = Path(run_dir)
        # wandb writes into dir/wandb/ and warns, then falls back to a temp dir, if dir does not exist.
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            group=cfg.group,
            name=cfg.name,
            tags=list(cfg.tags),
            mode=self.mode,
            dir=str(run_dir),
            config=config,
            # A sweep or a test runs several jobs in one process: each init must close the previous run.
            reinit="finish_previous",
            settings=wandb.Settings(**_cheap_settings(wandb)),
        )
        self._finished = False

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._run.log(dict(metrics), step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self._run.log({key: table})

    def log_image(self, key: str, path: str | os.PathLike[str]) -> None:
        self._run.log({key: self._wandb.Image(str(path))})

    def summary(self, metrics: dict[str, Any]) -> None:
        self._run.summary.update(dict(metrics))

    def finish(self, exit_code: int = 0) -> None:
        if self._finished:
            return
        self._finished = True
        self._run.finish(exit_code=exit_code)


def _cheap_settings(wandb_module: Any) -> dict[str, Any]:
    """Settings that keep a run cheap: no console capture, no system-stats sampler, no git/code/pip snapshot.

    Some of these are private (x_*) and come and go between wandb releases, so only the ones the installed
    version knows are passed; an unknown key would make wandb.Settings reject the whole object.
    """
    wanted = {
        "silent": True,
        "console": "off",
        "x_disable_stats": True,
        "x_disable_meta": True,
        "x_disable_machine_info": True,
        "x_save_requirements": False,
        "disable_git": True,
        "disable_code": True,
        "save_code": False,
        "disable_job_creation": True,
    }
    known = getattr(wandb_module.Settings, "model_fields", None)
    if known is None:  # not a pydantic model: pass only what every supported version has
        return {"silent": True, "console": "off"}
    return {k: v for k, v in wanted.items() if k in known}


def make_logger(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> Logger:
    """The logger for cfg.kind; `config` is the resolved run config that W&B stores with the run."""
    if cfg.kind == "none":
        return Logger()
    if cfg.kind == "wandb":
        return WandbLogger(cfg, run_dir, config)
    # LoggerConfig validates kind; this guards a config whose kind was changed after construction.
    raise SelfSpecError(f"logger.kind={cfg.kind!r} is not supported; allowed: {', '.join(LOGGER_KINDS)}")


@contextlib.contextmanager
def logging_run(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any]) -> Iterator[Logger]:
    """Yield a logger and always finish it, so a crashed job still leaves a closed (failed) run behind."""
    logger = make_logger(cfg, run_dir, config)
    try:
        yield logger
    except BaseException:
        # BaseException too: a Ctrl-C'd run should be marked failed rather than left open.
        logger.finish(exit_code=1)
        raise
    else:
        logger.finish(exit_code=0)
