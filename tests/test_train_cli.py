"""`python -m selfspec.train` as a user runs it (subprocesses: Hydra's global state stays out of pytest):
user errors are one line with exit status 2, a multirun with a failing job still writes its summary,
a killed run resumes from its last checkpoint, and torchrun trains with two processes."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "experiment=tiny",
    "+model.random_init.initializer_range=0.3",
    "data.val_prompts=2",
    "decode.max_new_tokens=8",
    "logger=none",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    e = dict(os.environ)
    e.update(SELFSPEC_CACHE=str(tmp_path_factory.mktemp("selfspec_cache")), HF_HUB_OFFLINE="1", WANDB_MODE="offline",
             PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return e


def train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "selfspec.train", *args]


def run(args: list[str], env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_bad_prompt_file_is_one_line_naming_file_and_line(tmp_path: Path, env: dict) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken"\n')
    p = run(train_cmd("model=tiny", "logger=none", "data=jsonl", f"data.path={bad}", f"hydra.run.dir={tmp_path / 'run'}"), env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [f"error: data.path={bad} line 2: not valid JSON (Expecting ',' delimiter)"]
    assert "Traceback" not in p.stdout
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "failed"


def test_bad_config_value_is_one_line(tmp_path: Path, env: dict) -> None:
    p = run(train_cmd("model=tiny", "trainer.max_steps=0", f"hydra.run.dir={tmp_path}"), env)
    assert p.returncode == 2 and p.stderr.strip() == "error: trainer.max_steps=0: must be an integer >= 1"


def test_two_runs_started_together_get_their_own_run_dirs(tmp_path: Path, env: dict) -> None:
    """Two runs in the same second (here: the same base name, at once) must not share a run dir: each keeps
    its own config, log and result."""
    base = tmp_path / "outputs" / "2026-01-01_12-00-00"
    args = [train_cmd("model=tiny", "logger=none", f"trainer.max_steps={n}", f"hydra.run.dir=${{unique_dir:{base}}}") for n in (0, -1)]
    procs = [subprocess.Popen(a, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in args]
    errors = sorted(p.communicate(timeout=300)[1].strip() for p in procs)
    assert errors == ["error: trainer.max_steps=-1: must be an integer >= 1", "error: trainer.max_steps=0: must be an integer >= 1"]
    dirs = sorted(p.name for p in base.parent.iterdir())
    assert dirs == ["2026-01-01_12-00-00", "2026-01-01_12-00-00_1"]
    results = sorted(json.loads((base.parent / d / "result.json").read_text())["error"] for d in dirs)
    assert "max_steps=-1" in results[0] and "max_steps=0" in results[1]  # neither result overwrote the other
    assert all((base.parent / d / ".hydra" / "config.yaml").is_file() for d in dirs)


def test_a_crafted_resume_file_is_one_line_and_runs_nothing(tmp_path: Path, env: dict) -> None:
    marker = tmp_path / "pwned"
    crafted = tmp_path / "step-0000001.pt"
    # A hand-written pickle that calls open(marker, "w") when unpickled: what an attacker would send.
    crafted.write_bytes(b"cbuiltins\nopen\n(S'%s'\nS'w'\ntR." % str(marker).encode())
    p = run(train_cmd(*TINY, f"trainer.resume={crafted}", f"hydra.run.dir={tmp_path / 'run'}"), env)
    assert p.returncode == 2 and not marker.exists()
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: trainer.resume: cannot read checkpoint {crafted}"), p.stderr


def test_multirun_with_a_failing_job_still_writes_the_summary(tmp_path: Path, env: dict) -> None:
    sweep = tmp_path / "sweep"
    p = run(train_cmd("-m", *TINY, "trainer.max_steps=3", "head.exit_layer=2,99", f"hydra.sweep.dir={sweep}"), env)
    assert p.returncode == 0, p.stderr[-3000:]
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1"]
    ok, failed = rows
    assert ok["status"] == "ok" and ok["head"] == "medusa" and ok["exit_layer"] == "2" and float(ok["tau"]) >= 1
    assert failed["status"] == "failed" and "head.exit_layer=99" in failed["error"]
    md = (sweep / "summary.md").read_text()
    assert "2 jobs, 1 ok, 1 failed." in md
    assert (sweep / "0" / "head" / "head.safetensors").is_file()


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(tmp_path: Path, env: dict) -> None:
    import torch

    from selfspec.training.checkpoint import checkpoint_files, load_checkpoint

    run_dir = tmp_path / "run"
    args = train_cmd(*TINY, "trainer.max_steps=300", "trainer.ckpt_every=5", "trainer.keep_checkpoints=3", f"hydra.run.dir={run_dir}")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not checkpoint_files(run_dir / "checkpoints") and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (run_dir / "head").exists()
    files = checkpoint_files(run_dir / "checkpoints")
    assert files and all(load_checkpoint(f)["step"] % 5 == 0 for f in files)  # whatever was there is complete
    p = run([*args, "trainer.resume=true"], env)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 300
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))
    assert load_checkpoint(checkpoint_files(run_dir / "checkpoints")[-1])["step"] == 300
    assert "resumed from" in (run_dir / "train.log").read_text()
    assert torch.load(run_dir / "checkpoints" / "step-0000300.pt", weights_only=True)["scheduler"]["last_epoch"] == 300


def test_torchrun_two_processes(tmp_path: Path, env: dict) -> None:
    run_dir = tmp_path / "ddp"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "selfspec.train",
            *TINY, "trainer.max_steps=4", "trainer.ckpt_every=2", f"hydra.run.dir={run_dir}"]
    p = run(args, env)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 4 and result["val/lossless"] == 1.0
    assert (run_dir / "head" / "head.safetensors").is_file()
    assert p.stdout.strip().splitlines()[-1] == f"head: {run_dir.resolve() / 'head'}"


@pytest.mark.slow
def test_optuna_sweep_runs_and_summarizes(tmp_path: Path, env: dict) -> None:
    sweep = tmp_path / "optuna"
    p = run(train_cmd("-m", *TINY, "hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.n_startup_trials=3",
                      'hydra.sweeper.params={head.exit_layer:"choice(2,5)",decode.draft_len:"range(2,4)"}',  # E=5 fails
                      "trainer.max_steps=2", f"hydra.sweep.dir={sweep}"), env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (sweep / "optimization_results.yaml").is_file()
    with (sweep / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    # TPE's first (seeded) trial is E=5, past the tiny model's last layer (E may be L=4): failed, and the study went on
    assert [r["status"] for r in rows] == ["failed", "ok", "ok"]
