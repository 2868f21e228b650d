"""python -m selfspec.train experiment=default   (or python -m selfspec.cli.train)

Self-distils an exit head on data the target generates itself, validates it by real self-speculative
decoding and writes head/, result.json, checkpoints/ (and wandb/) into the Hydra run dir
(selfspec/training/run.py, from the typed recipe `build_configs` makes of conf/train.yaml). The job returns the
result's `optimized_metric` (default val/speedup), what a sweep (hparams_search=optuna) optimizes.
See train/README.md.
"""

from __future__ import annotations

import os

# On a busy machine (other jobs on the same cores) OpenMP threads that spin while waiting for a preempted
# sibling make every op several times slower (measured here: a batched decode step 0.7 s -> 3.5-5.6 s with
# 2 threads); passive waiting avoids that at little cost. Read once, when torch loads: set it before that.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from selfspec.cli.config import decode_config, head_config, logger_config, model_config
from selfspec.cli.hydra_utils import RESULT_FILE, print_user_error_and_exit, run_job_safely
from selfspec.errors import SelfSpecError
from selfspec.training.config import DataConfig, TrainerConfig, TrainRunConfig
from selfspec.utils.config import build, to_dict
from selfspec.utils.logger import multirun_group_and_name
from selfspec.utils.markdown import table
from selfspec.utils.paths import conf_dir
from selfspec.utils.sweeps import write_json


# ------------------------------------------------------------------------------------------------ configs
def build_configs(cfg: DictConfig) -> TrainRunConfig:
    """Every group as a validated dataclass, before anything slow happens."""
    return TrainRunConfig(
        model=model_config(cfg.model),
        head=head_config(cfg.head),
        data=training_data_config(cfg.data),
        trainer=build(TrainerConfig, cfg.trainer, "trainer"),
        decode=decode_config(cfg.decode),
        logger=logger_config(cfg.logger),
    )


def training_data_config(node) -> DataConfig:
    """The data group (conf/data/, training's own) as a DataConfig. Its prompt-file presets (data=builtin,
    data=spec_bench) have no `source` and train as prompt files (the target answers them itself)."""
    if isinstance(node, DictConfig) and OmegaConf.is_missing(node, "path"):
        raise SelfSpecError("data.path: required for this data set (data.path=FILE)")
    d = to_dict(node)
    if "source" not in d:
        d["source"] = "jsonl"
        if not d.get("path"):  # data=builtin: the prompt file shipped in the package
            from importlib import resources

            d["path"] = str(resources.files("selfspec.data").joinpath("builtin_prompts.jsonl"))
            d.setdefault("format", "spec_bench")
    return build(DataConfig, d, "data")


def run_training(cfg: DictConfig, run_dir: Path, wandb_group: str | None = None, wandb_name: str | None = None) -> dict:
    """The job from a composed conf/train.yaml. -> the result dict written to run_dir/result.json ({} on ranks > 0
    under torchrun)."""
    from selfspec.training.run import run_recipe  # the training machinery loads when a job runs, not for --help

    return run_recipe(build_configs(cfg), run_dir, wandb_group, wandb_name, OmegaConf.to_container(cfg, resolve=True))


# ------------------------------------------------------------------------------------------------ reports


def _fmt(x, pattern: str = "{:.3f}") -> str:
    return "-" if x is None else pattern.format(x)


def comparison_table(rows: list[dict]) -> str:
    """Markdown: each method's acceptance, tau, speedup over our autoregressive path and over HF generate
    (when the validation timed it), and whether its greedy output equals the reference's on every prompt."""
    header = ["method", "exit_layer", "draft_len", "accept_rate", "tau", "speedup vs ours", "speedup vs HF generate",
              "lossless"]
    lines = []
    for r in rows:
        lossless = r.get("val/lossless")
        same = "-" if lossless is None else ("yes" if lossless == 1 else f"no ({lossless:.0%} of prompts)")
        lines.append([r["name"], _fmt(r["exit_layer"], "{}"), _fmt(r["draft_len"], "{}"), _fmt(r["val/accept_rate"]),
                      _fmt(r["val/tau"], "{:.2f}"), _fmt(r["val/speedup"], "{:.2f}x"),
                      _fmt(r.get("val/speedup_hf"), "{:.2f}x"), same])
    return "\n".join(table(header, lines))


def report(payload: dict) -> None:
    """What a person reads at the end of a run; the LAST line is `head: DIR`."""
    if payload.get("status") == "stopped":
        print(f"stopped at step {payload['steps']} (trainer.stop_after); continue with trainer.resume=true and the same hydra.run.dir")
        return
    if payload.get("compare"):
        print(comparison_table(payload["compare"]))
    else:
        print(f"val/tau={payload['val/tau']:.3f} val/accept_rate={payload['val/accept_rate']:.3f} val/speedup={payload['val/speedup']:.3f}")
    split = ("data_prompts_s", "data_answers_s")  # parts of data_s
    t = {k: v for k, v in payload["timings"].items() if k not in split}
    parts = [f"{k.removesuffix('_s')} {v:.0f}s" for k, v in t.items()]
    if split[0] in payload["timings"]:
        parts[1] += f" (prompts {payload['timings'][split[0]]:.0f}s, answers {payload['timings'][split[1]]:.0f}s)"
    print("time: " + ", ".join(parts) + f"; total {sum(t.values()):.0f}s")
    print(f"head: {payload['head_dir']}")


DEFAULT_METRIC = "val/speedup"


def optimized_metric(cfg: DictConfig) -> str:
    """The result key a job returns to the sweeper: `optimized_metric` (hparams_search=optuna sets it; any key of
    result.json: val/tau, val/accept_rate, ...), else val/speedup."""
    return str(cfg.get("optimized_metric") or DEFAULT_METRIC)


def objective(payload: dict, metric: str) -> float | None:
    """payload[metric] as a float; None (a failed trial for Optuna) for a stopped run, a rank > 0, or a metric the run
    did not produce (one warning line naming the keys it has)."""
    if not payload or payload.get("status") != "ok":
        return None
    value = payload.get(metric)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        import logging

        numeric = sorted(k for k, v in payload.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        logging.getLogger("selfspec.train").warning("optimized_metric=%s: not a number in this run's result (%r); "
                                                    "numbers there: %s", metric, value, ", ".join(numeric))
        return None
    return float(value)


# ------------------------------------------------------------------------------------------------ the job
def job(cfg: DictConfig) -> float | None:
    hc = HydraConfig.get()
    group, name = multirun_group_and_name()  # one sweep's runs share a W&B group; each is named after its overrides
    payload = run_training(cfg, Path(hc.runtime.output_dir), cfg.logger.group or group, cfg.logger.name or name)
    if payload:
        report(payload)
    return objective(payload, optimized_metric(cfg))


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        # A failing job records a failed result.json and returns None: the sweep goes on, and the Optuna
        # sweeper records None (not float-castable) as a failed trial.
        return run_job_safely(job, cfg)
    try:
        return job(cfg)
    except Exception as exc:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if run_dir.is_dir():
            write_json(run_dir / RESULT_FILE, {"status": "failed", "error": f"{type(exc).__name__}: {exc}"})
        if isinstance(exc, SelfSpecError):
            print_user_error_and_exit(exc)  # one line, exit 2, no traceback
        raise


if __name__ == "__main__":
    main()
