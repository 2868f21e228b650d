"""An Optuna sweep that a kill does not lose: hparams_search=optuna keeps its study in <sweep dir>/optuna_study.json,
and a relaunch with the same hydra.sweep.dir continues it.

The study is stored by `FileStorage`, Optuna's in-memory storage written to one JSON file after every change
(atomically): Optuna's own sqlite storage needs SQLAlchemy < 2 with the Optuna 2.x that hydra-optuna-sweeper allows
(with SQLAlchemy 2 it fails when it creates the database), so it is not the default; a sqlite:/// URL in
hydra.sweeper.storage still works where SQLAlchemy allows it.

Hydra's Optuna sweeper loads an existing study (load_if_exists) but then runs n_trials more and numbers its jobs
from 0 again, writing over the first jobs' directories. The sweeper of conf/hparams_search/optuna.yaml,
hydra_plugins/selfspec_sweeper (Hydra finds sweepers only in the hydra_plugins package), wraps it and first
(`prepare_resume`) reads the stored study: trials a killed sweep left running are marked failed (their jobs never reported), the
finished ones count towards hydra.sweeper.n_trials, and job numbers continue after the stored trials. One log line
says what was found.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import optuna
from optuna.distributions import distribution_to_json, json_to_distribution
from optuna.storages import InMemoryStorage
from optuna.study import StudyDirection
from optuna.trial import TrialState

from selfspec.utils.io import atomic_write_text

log = logging.getLogger(__name__)

_MUTATORS = ("create_new_study", "delete_study", "set_study_directions", "set_study_user_attr", "set_study_system_attr",
             "create_new_trial", "set_trial_state", "set_trial_param", "set_trial_values", "set_trial_intermediate_value",
             "set_trial_user_attr", "set_trial_system_attr", "set_trial_state_values")  # the last: Optuna >= 3


class FileStorage(InMemoryStorage):
    """Optuna's in-memory storage, kept in a JSON file: read when created, rewritten (atomically) after every change."""

    def __init__(self, path: str):
        super().__init__()
        self.path = Path(path)
        self._loading = True
        try:
            if self.path.is_file():
                self._load(json.loads(self.path.read_text(encoding="utf-8")))
        finally:
            self._loading = False

    def __repr__(self) -> str:
        return f"FileStorage({str(self.path)!r})"

    def _save(self) -> None:
        studies = []
        listed = self.get_all_studies() if hasattr(self, "get_all_studies") else self.get_all_study_summaries()
        for summary in listed:
            sid = self.get_study_id_from_name(summary.study_name)
            trials = [{"state": t.state.name, "values": t.values, "params": t.params,
                       "distributions": {k: distribution_to_json(d) for k, d in t.distributions.items()},
                       "user_attrs": t.user_attrs, "system_attrs": t.system_attrs,
                       "intermediate_values": {str(k): v for k, v in t.intermediate_values.items()}}
                      for t in self.get_all_trials(sid, deepcopy=False)]
            studies.append({"name": summary.study_name, "directions": [d.name for d in self.get_study_directions(sid)],
                            "user_attrs": self.get_study_user_attrs(sid), "system_attrs": self.get_study_system_attrs(sid),
                            "trials": trials})
        atomic_write_text(self.path, json.dumps({"format": "selfspec-optuna/1", "studies": studies}, default=str))

    def _load(self, data: dict) -> None:
        for study in data.get("studies", []):
            sid = self.create_new_study(study["name"])
            self.set_study_directions(sid, [StudyDirection[d] for d in study["directions"]])
            for k, v in study["user_attrs"].items():
                self.set_study_user_attr(sid, k, v)
            for k, v in study["system_attrs"].items():
                self.set_study_system_attr(sid, k, v)
            for t in study["trials"]:
                state = TrialState[t["state"]]
                with warnings.catch_warnings():  # create_trial is "experimental" in Optuna 2.x (stable since 3.0)
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    trial = optuna.trial.create_trial(
                        state=state, values=t["values"] if state == TrialState.COMPLETE else None, params=t["params"],
                        distributions={k: json_to_distribution(d) for k, d in t["distributions"].items()},
                        user_attrs=t["user_attrs"], system_attrs=t["system_attrs"],
                        intermediate_values={int(k): v for k, v in t["intermediate_values"].items()})
                self.create_new_trial(sid, template_trial=trial)


def _saving(name: str):
    base = getattr(InMemoryStorage, name)

    def method(self, *args, **kwargs):
        out = base(self, *args, **kwargs)
        if not self._loading:
            self._save()
        return out

    method.__name__ = method.__qualname__ = name
    return method


for _name in _MUTATORS:
    if hasattr(InMemoryStorage, _name):
        setattr(FileStorage, _name, _saving(_name))


def sqlite_file(storage) -> Path | None:
    """The database file of a sqlite:/// storage URL (None for another storage)."""
    text = str(storage or "")
    return Path(text.removeprefix("sqlite:///")) if text.startswith("sqlite:///") else None


def resume_study(storage, study_name: str, n_trials: int) -> tuple[int, int, int]:
    """The stored study `study_name`, made ready to continue -> (trials still to run, the next job number, trials a
    killed sweep left running, now marked failed). A study that is not stored yet: (n_trials, 0, 0)."""
    path = sqlite_file(storage)
    if path is not None and not path.is_file():  # a first launch (and no empty database left behind)
        return n_trials, 0, 0
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # no such study yet: a first launch
        return n_trials, 0, 0
    trials = study.get_trials(deepcopy=False)
    running = [t for t in trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]
    for t in running:  # their jobs were killed with the sweep: they will never report
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    finished = len(trials) - len(running)
    return max(0, n_trials - finished), len(trials), len(running)


def prepare_resume(impl) -> None:
    """Before hydra-optuna-sweeper's OptunaSweeperImpl.sweep: continue its stored study (see the module doc)."""
    path = sqlite_file(impl.storage)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)  # sqlite creates the file, not its directory
    if impl.storage is None or not impl.study_name:
        return
    remaining, next_job, killed = resume_study(impl.storage, impl.study_name, impl.n_trials)
    if next_job:
        log.info("optuna: continuing study %r from %s: %d of %d trials done (%d left running by a killed sweep, "
                 "marked failed); %d to run, jobs numbered from %d", impl.study_name, impl.storage,
                 next_job - killed, impl.n_trials, killed, remaining, next_job)
    impl.n_trials, impl.job_idx = remaining, next_job  # setup() set job_idx to 0; sweep() starts from it
