"""ResumableOptunaSweeper: hydra-optuna-sweeper's OptunaSweeper, continuing the stored study of a killed sweep
(selfspec/cli/optuna_sweeper.py). Hydra imports every module of hydra_plugins at start-up, so Optuna is imported only
when this sweeper is used."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper


class ResumableOptunaSweeper(Sweeper):
    """conf/hparams_search/optuna.yaml's sweeper: the keys of hydra-optuna-sweeper's OptunaSweeper."""

    def __init__(self, **kwargs: Any) -> None:
        from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

        self.optuna = OptunaSweeper(**kwargs)

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.optuna.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        from selfspec.cli.optuna_sweeper import prepare_resume

        prepare_resume(self.optuna.sweeper)
        return self.optuna.sweep(arguments)
