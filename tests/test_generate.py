"""python -m selfspec.generate: writes nothing but `output=`, and bad values are one line with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _generate(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfspec.generate", "model=tiny", "prompt=hello",
                           "decode.max_new_tokens=4", *args], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=300)


def test_writes_only_the_output_file(tmp_path):
    """It used to leave generate.log (Hydra's job log) in the working directory."""
    out = _generate(tmp_path)
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == []
    out = _generate(tmp_path, "output=result.json")
    assert out.returncode == 0, out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
    record = json.loads((tmp_path / "result.json").read_text())
    assert len(record["token_ids"]) == 4 and record["stats"]["new_tokens"] == 4


def test_bad_values_are_one_line(tmp_path):
    (tmp_path / "taken").mkdir()
    cases = [
        (["output=taken"], "output='taken': is a directory"),
        (["decode.seed=abc"], "decode.seed='abc': must be an integer or null"),
        (["decode.temperature=1e-45"], "decode.temperature=1e-45: must be 0 (greedy) or >= 0.0001"),
        (["head=medusa", "head.num_blocks=null"], "head.num_blocks=None: must be an integer >= 0"),
        (["head=medusa", "head.draft_vocab='64'"], "head.draft_vocab='64': must be an integer >= 1"),
        (["head=medusa", "+head.num_block=2"], "head: unknown key(s) num_block for head type 'medusa'"),
    ]
    for extra, expected in cases:
        out = _generate(tmp_path, *extra)
        assert out.returncode == 2, (extra, out.stderr)
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (extra, out.stderr)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and list((tmp_path / "taken").iterdir()) == []
