"""The Hydra configs (as selfspec/conf) and the shipped heads ship inside the wheel and are found from there."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_configs(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True, timeout=300, capture_output=True,
    )
    wheel = next(tmp_path.glob("selfspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("selfspec/conf/generate.yaml", "selfspec/conf/model/smollm2_135m.yaml", "selfspec/conf/head/medusa.yaml",
                 "selfspec/data/builtin_prompts.jsonl", "selfspec/data/excluded/spec_bench.json",
                 "selfspec/heads/shipped/smollm2_135m/head.safetensors",
                 "selfspec/heads/shipped/smollm2_135m/head_config.json", "selfspec/heads/shipped/smollm2_135m/README.md",
                 "selfspec/conf/model/random/qwen2.yaml",  # configs in subfolders (eval/gpu_check.sh's models)
                 "selfspec/cli/train.py", "selfspec/training/mix/build.py",  # subpackages listed by hand in pyproject
                 "hydra_plugins/selfspec_sweeper/resumable_optuna.py"):  # hparams_search=optuna's sweeper
        assert name in names, name
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "from selfspec.utils.paths import conf_dir; from hydra import compose, initialize_config_dir;"
        "d = conf_dir(); assert str(d).startswith(%r), d;"
        "initialize_config_dir(config_dir=str(d), version_base='1.3').__enter__();"
        "c = compose('generate', overrides=['head=medusa']); print(d, c.head.type)"
    ) % str(site)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("medusa")
