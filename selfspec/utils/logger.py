"""Experiment logging behind one small interface, so that training and evaluation code never does I/O itself.

`make_logger` returns a `WandbLogger` or a no-op `Logger`; the algorithm only ever calls `log`, `log_table`,
`log_image`, `summary`, `log_artifact`, `use_artifact` and `finish`. W&B runs offline unless the user has asked for,
or has set up, online use: a research run on a machine without credentials must neither prompt for a login nor try
the network.

How runs link up: training logs its head as an artifact (type `head`, named by `head_artifact_name`), and eval
declares the head it decodes with as its input (`use_artifact`: the same files under the same name are the same
artifact version, so W&B draws the lineage). Offline, W&B cannot declare inputs (it raises), so an offline eval run
records the head by reference instead: a `head-reference` artifact pointing at the head's directory (file://) and
`inputs.head` in its config (artifact name, digest, path), which match the training run's artifact. Every run
carries a `job_type` (train, eval, analyze); a multirun's jobs share a group named after the sweep dir and are
named after their overrides (`multirun_group_and_name`). A resumed training continues its run: the run id is kept
beside the checkpoints and passed back with resume="allow".
"""

from __future__ import annotations

import contextlib
import logging
import netrc
import os
import re
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
    entity: str | None = None  # the W&B user or team the run belongs to (None: the account's default entity)
    job_type: str | None = None  # train | eval | analyze (set by each program unless given)

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

    def log_artifact(self, path: str | os.PathLike[str], name: str, type: str, metadata: dict | None = None) -> dict | None:
        """Record the directory `path` as an output artifact -> {"name", "type", "digest"} (None: not logged)."""
        return None

    def use_artifact(self, path: str | os.PathLike[str], name: str, type: str, metadata: dict | None = None) -> dict | None:
        """Declare the directory `path` (what a run logged as artifact `name`) as this run's input -> {"name", "type",
        "digest", "path", "how"} (None: not logged)."""
        return None

    @property
    def run_id(self) -> str | None:
        """The run's id (what resuming it needs); None without a run."""
        return None

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; exit_code != 0 marks it failed. Safe to call more than once."""


class WandbLogger(Logger):
    """A W&B run; offline runs land in `run_dir/wandb/offline-run-*` and can be pushed later with `wandb sync`."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None) -> None:
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
            entity=cfg.entity,
            job_type=cfg.job_type,
            # run_id: continue that run (a resumed training), or start it when W&B has none of that id
            id=run_id,
            resume="allow" if run_id else None,
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

    def _artifact(self, path, name: str, type: str, metadata: dict | None):
        artifact = self._wandb.Artifact(name, type=type, metadata=dict(metadata or {}))
        artifact.add_dir(str(path))
        return artifact

    def log_artifact(self, path, name: str, type: str, metadata: dict | None = None) -> dict | None:
        artifact = self._artifact(path, name, type, metadata)
        self._run.log_artifact(artifact)
        return {"name": name, "type": type, "digest": artifact.digest}

    def use_artifact(self, path, name: str, type: str, metadata: dict | None = None) -> dict | None:
        artifact = self._artifact(path, name, type, metadata)  # the same files: the same digest as the logged one
        info = {"name": name, "type": type, "digest": artifact.digest, "path": str(Path(path).resolve())}
        if self.mode == "online":
            self._run.use_artifact(artifact)  # W&B finds the version with this digest: the training run's
            info["how"] = "use_artifact"
        else:  # offline W&B cannot declare inputs: a reference by path, and the input in the run's config
            reference = self._wandb.Artifact(artifact_name(f"{name}-ref"), type=f"{type}-reference",
                                             metadata={"artifact": name, "digest": artifact.digest, **(metadata or {})})
            reference.add_reference(Path(info["path"]).as_uri(), checksum=True)
            self._run.log_artifact(reference)
            info["how"] = "reference"
        self._run.config.update({"inputs": {type: info}}, allow_val_change=True)
        return info

    @property
    def run_id(self) -> str | None:
        return self._run.id

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


def artifact_name(*parts: object) -> str:
    """A W&B artifact name from parts: joined with '-', every character W&B does not allow replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", "-".join(str(p) for p in parts))[:128]


def head_artifact_name(model_name: str, head_type: str, exit_layer: int) -> str:
    """The artifact a trained head is logged as (training) and used as (eval): head-<model>-<type>-E<e>; W&B keeps one
    version per distinct content."""
    return artifact_name("head", model_name, head_type, f"E{exit_layer}")


def multirun_group_and_name() -> tuple[str | None, str | None]:
    """Inside a Hydra multirun job: (W&B group: sweep-<sweep dir name>, run name: the job's overrides, else its number);
    (None, None) otherwise. Training, eval and analyze name their runs alike."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except (ImportError, ValueError):  # not inside a Hydra job
        return None, None
    if hc.mode != RunMode.MULTIRUN:
        return None, None
    return f"sweep-{Path(hc.sweep.dir).name}", hc.job.override_dirname or str(hc.job.num)


def run_config(cfg: LoggerConfig, job_type: str) -> LoggerConfig:
    """cfg with what the program fills in unless the user set it: the job type, and a multirun's group and name."""
    from dataclasses import replace

    group, name = multirun_group_and_name()
    return replace(cfg, job_type=cfg.job_type or job_type, group=cfg.group or group, name=cfg.name or name)


def make_logger(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None) -> Logger:
    """The logger for cfg.kind; `config` is the resolved run config that W&B stores with the run; run_id: continue
    that W&B run (resume="allow")."""
    if cfg.kind == "none":
        return Logger()
    if cfg.kind == "wandb":
        return WandbLogger(cfg, run_dir, config, run_id)
    # LoggerConfig validates kind; this guards a config whose kind was changed after construction.
    raise SelfSpecError(f"logger.kind={cfg.kind!r} is not supported; allowed: {', '.join(LOGGER_KINDS)}")


@contextlib.contextmanager
def logging_run(cfg: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None) -> Iterator[Logger]:
    """Yield a logger and always finish it, so a crashed job still leaves a closed (failed) run behind."""
    logger = make_logger(cfg, run_dir, config, run_id)
    try:
        yield logger
    except BaseException:
        # BaseException too: a Ctrl-C'd run should be marked failed rather than left open.
        logger.finish(exit_code=1)
        raise
    else:
        logger.finish(exit_code=0)
