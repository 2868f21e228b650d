"""The result record: one JSON file per eval run (`record.json`, beside summary.md) that says what was measured, on
what, by which code and command, so that every number quoted elsewhere can be traced to a file and re-rendered from
it (`python -m selfspec.cli.results`). Plain JSON only: records are read back with json.loads, never unpickled.

Schema `selfspec-result/1` (every key always present; null where unknown):

    schema        "selfspec-result/1"
    created       UTC time the run finished, ISO 8601
    code          {"commit": git HEAD or null, "dirty": true/false/null (uncommitted changes to tracked files),
                   "version": the package version}
    command       {"argv": the command line, "overrides": Hydra's task overrides}
    machine       {"cpu": {"model_name", "vendor", "family", "model", "flags": [avx2, avx512f, avx512_vnni, amx_int8,
                   ...], "cores", "machine"}, "software": {"torch", "blas", "python", "threads", "gpu"?},
                   "threads": the thread policy's summary (busy prompts, mean load of other processes)}
    busy          whether other processes took cores during the run (machine.threads.busy > 0)
    model         {"name", "dtype", "device", "layers"}
    prompts       {"source": the prompts group's type and path, "count", "sha256": of the items' ids, categories and
                   turns, "max_new_tokens"}
    reference     the method speedups are measured against
    methods       {name: {"tokens_per_s", "speedup", "speedup_ci95": [lo, hi] (bootstrap over prompts), "tau",
                   "accept_rate", "lossless", "draft_mb", "prompts", "new_tokens", "head": what drafted, or null}}
    head          the run's head as summary.json's run.head describes it (type, exit layer, source, precision)
    auto_head     head=auto's choice: the candidate, its reason, and every candidate's profile, costs and prediction
                   (null when the run named its head)
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from selfspec.errors import check
from selfspec.evaluation.runner import HEAD_METHODS, parse_method

SCHEMA = "selfspec-result/1"
REPO_ROOT = Path(__file__).resolve().parents[2]
METHOD_KEYS = ("tokens_per_s", "speedup", "speedup_ci95", "tau", "accept_rate", "lossless", "prompts", "new_tokens")


def code_version(root: Path = REPO_ROOT) -> dict:
    """The git commit of the checkout this package runs from and whether tracked files differ from it; nulls when
    it is not a git checkout (an installed wheel) or git is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg = version("selfspec")
    except PackageNotFoundError:
        pkg = None
    out = {"commit": None, "dirty": None, "version": pkg}
    if not (root / ".git").exists():
        return out
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return out
    if head.returncode == 0:
        out["commit"] = head.stdout.strip()
        out["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return out


def prompts_digest(items) -> str:
    """sha256 over the prompt items' ids, categories and turns in order: two runs with the same digest timed the
    same prompts."""
    canon = [[str(it.id), str(getattr(it, "category", "")), list(it.turns)] for it in items]
    return hashlib.sha256(json.dumps(canon, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def method_entry(m: dict, head: dict | None) -> dict:
    out = {k: m.get(k) for k in METHOD_KEYS}
    out["draft_mb"] = m.get("draft_memory_mb")
    out["head"] = head
    return out


def build_record(summary: dict, info: dict, *, machine: dict, code: dict, command: dict, model: dict,
                 prompts: dict) -> dict:
    """The record of one run from its summary (report.summarize_methods) and run info (summary.json's "run");
    the caller supplies what it read from the machine, git and the command line, and writes the file."""
    heads = _method_heads(summary, info)
    threads = machine.get("threads") or {}
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code": code,
        "command": command,
        "machine": machine,
        "busy": bool(threads.get("busy")),
        "model": model,
        "prompts": prompts,
        "reference": summary.get("reference"),
        "methods": {name: method_entry(m, heads.get(name)) for name, m in summary["methods"].items()},
        "head": info.get("head"),
        "auto_head": info.get("auto_head"),
    }


def _method_heads(summary: dict, info: dict) -> dict[str, dict | None]:
    """Which head each drafting method drafted with: its own (a `head=` variant) or the run's."""
    run_head = info.get("head")
    own = info.get("method_heads") or {}
    out: dict[str, dict | None] = {}
    for name in summary["methods"]:
        spec = parse_method(name)
        if spec.base not in HEAD_METHODS:
            out[name] = None
            continue
        head = dict(own.get(name) or {}) if "head" in spec.settings else dict(run_head or {})
        for key in ("draft_precision", "own_precision"):
            if key in spec.settings:
                head[key] = spec.settings[key]
        out[name] = head or None
    return out


def command_line(module: str, overrides: list[str] | None = None) -> dict:
    """The command as typed (`python -m MODULE` and this process's arguments) and Hydra's task overrides."""
    return {"argv": ["python", "-m", module, *sys.argv[1:]], "overrides": list(overrides or [])}


def check_record(rec, where: str) -> None:
    """Raise SelfSpecError naming `where` when `rec` is not a record this version renders."""
    check(isinstance(rec, dict), f"{where}: not a JSON object")
    check(rec.get("schema") == SCHEMA, f"{where}: schema {rec.get('schema')!r}, expected {SCHEMA!r}")
    for key in ("code", "machine", "model", "prompts", "methods", "reference"):
        check(key in rec, f"{where}: no '{key}'")
    check(isinstance(rec["methods"], dict) and rec["methods"], f"{where}: 'methods' must be a non-empty object")
    check(isinstance(rec["machine"], dict) and isinstance(rec["machine"].get("cpu"), dict),
          f"{where}: 'machine.cpu' must be an object")
