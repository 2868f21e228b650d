"""W&B runs that link up (issue 23, item 5), checked in the offline runs' own records (tests/wandb_records.py):
training logs its head as an artifact and a resumed training continues its run; eval and analyze declare the heads
they use (offline: by reference, with the training artifact's name and digest in their config), eval logs a
per-prompt table, and their multiruns are grouped and named like training's, each run with its job type and entity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.utils.logger import LoggerConfig, head_artifact_name, make_logger
from test_train import TINY, compose_train
from wandb_records import offline_runs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Offline W&B with its own home (no credentials, nothing written to the real one); SELFSPEC_CACHE in tmp."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    env = {"HOME": str(home), "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "cfg"),
           "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
           "SELFSPEC_CACHE": str(tmp_path / "selfspec_cache"), "HF_HUB_OFFLINE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _app(module: str, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.fixture
def trained(tmp_path: Path, wandb_env: dict) -> tuple[Path, dict]:
    """A training stopped at step 3, then resumed to its end (logger=wandb, logger.entity set) -> (run dir, result)."""
    from selfspec.cli.train import run_training

    run_dir = tmp_path / "train"
    args = [*TINY, "logger=wandb", "logger.entity=selfspec-team", "trainer.max_steps=6"]
    stopped = run_training(compose_train(*args, "trainer.stop_after=3"), run_dir)
    assert stopped["status"] == "stopped" and "head_artifact" not in stopped
    done = run_training(compose_train(*args, "trainer.resume=true"), run_dir)
    assert done["status"] == "ok" and done["steps"] == 6
    return run_dir, done


def test_training_logs_its_head_and_a_resumed_training_continues_its_run(trained) -> None:
    run_dir, done = trained
    first, second = offline_runs(run_dir)
    saved_id = (run_dir / "checkpoints" / "wandb-run-id").read_text().strip()
    assert first.run_id == second.run_id == saved_id  # the resumed training continued the run
    assert first.job_type == second.job_type == "train" and first.entity == "selfspec-team"
    assert not [a for a in first.artifacts if a["type"] == "head"]  # the stopped run had no head yet
    (head,) = [a for a in second.artifacts if a["type"] == "head"]
    assert head["name"] == head_artifact_name("tiny", "medusa", 2) == done["head_artifact"]["name"]
    assert head["digest"] == done["head_artifact"]["digest"] and head["metadata"]["steps"] == 6


def test_eval_and_analyze_multiruns_use_the_trained_head(trained, tmp_path: Path, wandb_env: dict) -> None:
    run_dir, done = trained
    head_dir = done["head_dir"]
    common = ["model=tiny", "+model.random_init.initializer_range=0.3", "logger=wandb", "head_cache.train_missing=false"]
    sweep = tmp_path / "eval_sweep"
    _app("selfspec.eval", ["-m", *common, f"head.path={head_dir}", "methods=[autoregressive,selfspec]", "prompts.limit=2",
                           "decode.max_new_tokens=8", "decode.draft_len=2,3", f"hydra.sweep.dir={sweep}"], wandb_env, tmp_path)
    runs = [r for job in ("0", "1") for r in offline_runs(sweep / job)]
    # named like training's jobs: after the job's overrides (Hydra's override_dirname)
    assert ["decode.draft_len=2," in runs[0].name, "decode.draft_len=3," in runs[1].name] == [True, True]
    assert {r.group for r in runs} == {f"sweep-{sweep.name}"} and {r.job_type for r in runs} == {"eval"}
    for r in runs:
        head = r.config["inputs"]["head"]  # offline: the input by reference, matching the training artifact
        assert (head["name"], head["digest"]) == (done["head_artifact"]["name"], done["head_artifact"]["digest"])
        (ref,) = [a for a in r.artifacts if a["type"] == "head-reference"]
        assert ref["metadata"]["digest"] == head["digest"] and ref["refs"]
        assert all(x.startswith(Path(head_dir).as_uri()) for x in ref["refs"])
        assert [a for a in r.artifacts if a["type"] == "run_table" and "per_prompt" in a["name"]]  # the per-prompt table

    asweep = tmp_path / "analyze_sweep"
    _app("selfspec.analyze", ["-m", "model=tiny", "+model.random_init.initializer_range=0.3", "logger=wandb",
                              f"heads=[{head_dir}]", "prompts.limit=1", "costs=false", "max_new_tokens=6,8",
                              f"hydra.sweep.dir={asweep}"], wandb_env, tmp_path)
    runs = [r for job in ("0", "1") for r in offline_runs(asweep / job)]
    assert ["max_new_tokens=6" in runs[0].name, "max_new_tokens=8" in runs[1].name] == [True, True]
    assert {r.group for r in runs} == {f"sweep-{asweep.name}"} and {r.job_type for r in runs} == {"analyze"}
    assert all(r.config["inputs"]["head"]["digest"] == done["head_artifact"]["digest"] for r in runs)


def test_online_eval_declares_the_training_artifact(tmp_path: Path, wandb_env: dict) -> None:
    """Online, use_artifact gets an artifact of the same name and files, hence the same digest, as the one training
    logged: W&B resolves it to that version (lineage). Checked with the run's use_artifact recorded."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "head_config.json").write_text('{"type": "medusa"}')
    (head / "head.safetensors").write_bytes(b"\0" * 64)
    logger = make_logger(LoggerConfig(job_type="eval"), tmp_path / "run", {})
    try:
        logged = logger.log_artifact(head, "head-tiny-medusa-E2", "head")
        used = []
        logger.mode = "online"
        logger._run.use_artifact = lambda artifact, *a, **k: used.append(artifact)
        info = logger.use_artifact(head, "head-tiny-medusa-E2", "head")
    finally:
        logger.finish()
    assert info["how"] == "use_artifact" and info["digest"] == logged["digest"]
    (artifact,) = used
    assert (artifact.name.split(":")[0], artifact.type, artifact.digest) == ("head-tiny-medusa-E2", "head", logged["digest"])


def test_per_prompt_rows_pool_turns_and_compare_with_the_reference() -> None:
    from selfspec.cli.eval import PER_PROMPT_COLUMNS, per_prompt_rows

    def rec(method, pid, ids, steps, sampled=False):
        return {"method": method, "prompt_id": pid, "category": "qa", "token_ids": ids, "text": "t", "sampled": sampled,
                "stats": {"new_tokens": len(ids), "verify_steps": steps, "accepted": 1, "drafted": 2, "seconds": 0.5}}

    records = [rec("autoregressive", "a", [1, 2], 2), rec("selfspec", "a", [1, 2], 1), rec("selfspec", "a", [3], 1),
               rec("autoregressive", "a", [3], 1), rec("selfspec", "b", [5], 1), rec("autoregressive", "b", [6], 1)]
    rows = {(r[0], r[1]): dict(zip(PER_PROMPT_COLUMNS, r)) for r in per_prompt_rows(records, "autoregressive")}
    a = rows[("selfspec", "a")]
    assert a["turns"] == 2 and a["new_tokens"] == 3 and a["tau"] == 1.5 and a["accept_rate"] == 0.5
    assert a["tokens_per_s"] == 3.0 and a["same_as_reference"] is True and a["text"] == "t\n\nt"
    assert rows[("selfspec", "b")]["same_as_reference"] is False
    assert rows[("autoregressive", "a")]["same_as_reference"] is None  # the reference itself
    sampled = per_prompt_rows([rec("selfspec", "a", [1], 1, True), rec("autoregressive", "a", [2], 1)], "autoregressive")
    assert sampled[0][PER_PROMPT_COLUMNS.index("same_as_reference")] is None
