"""Hydra sweeps and jobs that survive interruptions (issue 23, item 6): `optimized_metric` is what a job returns, the
Optuna study lives in the sweep dir and a relaunch continues it, a requeued or relaunched SLURM job continues from its
checkpoints, and the eval head cache says when and what it trains."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_train import TINY, compose_train

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ optimized_metric
def test_the_job_returns_the_optimized_metric() -> None:
    from selfspec.cli.train import objective, optimized_metric

    assert optimized_metric(compose_train(*TINY)) == "val/speedup"
    assert optimized_metric(compose_train(*TINY, "optimized_metric=val/tau")) == "val/tau"
    assert optimized_metric(compose_train(*TINY, "hparams_search=optuna", "optimized_metric=val/accept_rate")) == "val/accept_rate"
    payload = {"status": "ok", "val/speedup": 0.9, "val/tau": 1.7, "steps": 6}
    assert objective(payload, "val/tau") == 1.7 and objective(payload, "val/speedup") == 0.9
    assert objective({**payload, "status": "stopped"}, "val/tau") is None  # a stopped run is no result
    assert objective(payload, "val/nothing") is None and objective({}, "val/tau") is None


# ------------------------------------------------------------------------------------------------ optuna storage
def test_a_stored_study_continues_where_it_stopped(tmp_path: Path) -> None:
    import optuna

    from selfspec.cli.optuna_sweeper import FileStorage, resume_study, sqlite_file

    assert sqlite_file(f"sqlite:///{tmp_path}/optuna.db") == tmp_path / "optuna.db" and sqlite_file("postgresql://x") is None
    path = tmp_path / "sweep" / "optuna_study.json"
    storage, url = (lambda: FileStorage(str(path))), None  # each call: a new process reading the file
    fresh = storage() if url is None else storage
    assert resume_study(fresh, "s", 5) == (5, 0, 0)  # nothing stored yet
    study = optuna.create_study(study_name="s", storage=fresh, direction="maximize")
    for value in (1.0, 2.0):
        t = study.ask()
        t.suggest_int("k", 1, 9)
        study.tell(t, value)
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)
    study.ask()  # a trial whose job was killed with the sweep: left RUNNING in the storage
    again = storage() if url is None else storage  # a new process reads what the killed one stored
    remaining, next_job, killed = resume_study(again, "s", 5)
    assert (remaining, next_job, killed) == (2, 4, 1)  # 3 trials finished (failed ones too), jobs 0-3 taken
    stored = optuna.load_study(study_name="s", storage=storage() if url is None else storage)
    assert [t.state for t in stored.trials][-1] == optuna.trial.TrialState.FAIL  # the killed trial no longer looks alive
    assert [t.value for t in stored.trials][:2] == [1.0, 2.0] and stored.best_trial.params["k"] == stored.trials[1].params["k"]
    assert resume_study(storage() if url is None else storage, "s", 2)[0] == 0  # done already


def _train_app(args: list[str], env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "selfspec.train", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_a_relaunched_optuna_sweep_continues_its_study(tmp_path: Path) -> None:
    import optuna

    from selfspec.cli.optuna_sweeper import FileStorage

    env = {**os.environ, "SELFSPEC_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "PYTHONUNBUFFERED": "1"}
    sweep = tmp_path / "optuna"
    args = ["-m", *TINY, "logger=none", "hparams_search=optuna", "optimized_metric=val/tau", "trainer.max_steps=2",
            "hydra.sweeper.sampler.n_startup_trials=5",
            'hydra.sweeper.params={head.exit_layer:2,head.num_blocks:1,decode.draft_len:"range(1,5)"}',
            f"hydra.sweep.dir={sweep}"]
    _train_app([*args, "hydra.sweeper.n_trials=2"], env)
    first = {job: (sweep / job / "result.json").stat().st_mtime_ns for job in ("0", "1")}
    p = _train_app([*args, "hydra.sweeper.n_trials=3"], env)  # as after a kill: the same sweep dir, relaunched
    assert "continuing study 'selfspec_heads'" in p.stdout + p.stderr
    trials = optuna.load_study(study_name="selfspec_heads", storage=FileStorage(str(sweep / "optuna_study.json"))).trials
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert {job: (sweep / job / "result.json").stat().st_mtime_ns for job in ("0", "1")} == first  # not run again
    taus = [json.loads((sweep / str(i) / "result.json").read_text())["val/tau"] for i in range(3)]
    assert [t.value for t in trials] == taus  # the trials' values are the jobs' optimized_metric
    best = (sweep / "optimization_results.yaml").read_text()
    assert f"best_value: {max(taus)}" in best


# ------------------------------------------------------------------------------------------------ SLURM requeue
@pytest.fixture
def cache_env(tmp_path_factory, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path_factory.mktemp("selfspec_cache")
    monkeypatch.setenv("SELFSPEC_CACHE", str(cache))
    return cache


def _run(run_dir: Path, *overrides: str) -> dict:
    from selfspec.cli.train import run_training

    return run_training(compose_train(*TINY, "logger=none", "trainer.max_steps=8", *overrides), run_dir)


def test_a_relaunched_slurm_job_continues_from_its_checkpoints(tmp_path: Path, cache_env: Path, monkeypatch, caplog) -> None:
    from selfspec.training.checkpoint import checkpoint_files, load_checkpoint

    straight = _run(tmp_path / "straight")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    # preempted after step 4 (its checkpoints go where the job's config, not its fresh run dir, says) ...
    stopped = _run(tmp_path / "2026-01-01_10-00-00", "trainer.stop_after=4")
    assert stopped["status"] == "stopped" and not (tmp_path / "2026-01-01_10-00-00" / "checkpoints").exists()
    (ckpt_dir,) = (cache_env / "checkpoints").iterdir()
    assert ckpt_dir.name.startswith("tiny-medusa-E2-") and load_checkpoint(checkpoint_files(ckpt_dir)[-1])["step"] == 4
    # ... and requeued or relaunched: a new timestamped run dir, trainer.resume left at its default (auto)
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    with caplog.at_level(logging.INFO, logger="selfspec.train"):
        resumed = _run(tmp_path / "2026-01-01_11-30-00")
    assert resumed["status"] == "ok" and resumed["steps"] == 8
    assert any("resumed from" in r.getMessage() and str(ckpt_dir) in r.getMessage() for r in caplog.records)
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step-0000008.pt")
    b = load_checkpoint(checkpoint_files(ckpt_dir)[-1])
    for name, t in a["params"].items():  # the same training as one that was never interrupted
        assert torch.equal(t, b["params"][name]), name
    # another config is another job: it starts at step 0
    other = _run(tmp_path / "other", "trainer.lr=0.002", "trainer.stop_after=2")
    assert other["steps"] == 2 and len(list((cache_env / "checkpoints").iterdir())) == 2
    # outside SLURM a new run dir is a new run (trainer.resume=auto finds nothing there)
    monkeypatch.delenv("SLURM_JOB_ID")
    fresh = _run(tmp_path / "local", "trainer.stop_after=2")
    assert fresh["steps"] == 2 and [p.name for p in checkpoint_files(tmp_path / "local" / "checkpoints")] == ["step-0000002.pt"]


def test_trainer_checkpoint_dir_is_used_and_resumed(tmp_path: Path, cache_env: Path) -> None:
    ckpt = tmp_path / "ckpts"
    assert _run(tmp_path / "a", f"trainer.checkpoint_dir={ckpt}", "trainer.stop_after=3")["steps"] == 3
    assert _run(tmp_path / "b", f"trainer.checkpoint_dir={ckpt}")["steps"] == 8
    assert (ckpt / "step-0000008.pt").is_file() and not (tmp_path / "b" / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------ eval head cache
def test_the_head_cache_says_when_and_what_it_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from conftest import make_tiny
    from selfspec.evaluation import head_cache
    from selfspec.heads import HeadConfig, build_head, save_head
    from selfspec.training import TrainerConfig, TrainRunConfig

    m = make_tiny("llama")

    def fake_train_head(recipe, run_dir) -> Path:
        head = build_head(HeadConfig(type="medusa", exit_layer=recipe.head.exit_layer), m.backbone)
        return save_head(head, tmp_path / "trained", m.backbone)

    monkeypatch.setattr(head_cache, "_trainer", lambda: fake_train_head)
    recipe = TrainRunConfig(model=m.model_config, head=None, trainer=TrainerConfig(max_steps=7))
    kw = dict(model_name="tiny", root=tmp_path / "heads", recipe=recipe, train_dir=tmp_path / "eval" / "train")
    with caplog.at_level(logging.INFO, logger="selfspec.evaluation.head_cache"):
        head, source = head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, **kw)
        lines = [r.getMessage() for r in caplog.records if r.name == "selfspec.evaluation.head_cache"]
        assert source == "trained" and len(lines) == 2, lines
        start, end = lines
        assert "training one now" in start and "medusa head at E=2 for tiny" in start
        assert "trainer.max_steps=7" in start and str(tmp_path / "eval" / "train" / "medusa-E2") in start
        assert "trained the medusa head at E=2" in end and str(head.source_dir) in end
        caplog.clear()
        assert head_cache.resolve_head(m, HeadConfig(type="medusa"), exit_layer=2, **kw)[1] == "cache"
        assert not [r for r in caplog.records if "train" in r.getMessage()]  # a cached head trains nothing, says nothing
