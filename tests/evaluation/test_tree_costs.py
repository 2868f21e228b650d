"""Verify cost vs rows (selfspec/evaluation/tree_costs.py, eval/verify_rows.py) on a tiny model: it runs and
reports positive ratios and which path (C layer or torch) ran; the timing itself is for a quiet machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.evaluation.tree_costs import tree_parents, verify_rows_costs, verify_rows_markdown
from selfspec.model import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_tree_parents_is_a_full_tree_in_depth_order():
    assert tree_parents(7, 2) == [-1, 0, 0, 1, 1, 2, 2]
    assert tree_parents(1) == [-1]


def test_verify_rows_costs_on_a_tiny_model():
    bb = make_tiny("llama").backbone
    costs = verify_rows_costs(bb, rows=[1, 4, 20], context=30, repeats=1, warmup=0)
    assert list(costs["rows"]) == [1, 4, 20] and costs["ar_step_s"] > 0
    for T, v in costs["rows"].items():
        assert v["tree"] > 0 and v["tree_torch"] > 0 and v["chain"] > 0
        kernels = cpu_kernels.load_kernel() is not None
        assert v["tree_c_layer"] == (kernels and T <= cpu_kernels.TREE_MAX_ROWS)
        assert v["chain_c_layer"] == (kernels and T <= cpu_kernels.MAX_ROWS)
    md = verify_rows_markdown(costs)
    assert "| 20 |" in md and md.count("\n| ") == 1 + 3  # header, three rows
    with pytest.raises(SelfSpecError, match="verify_rows.rows"):
        verify_rows_costs(bb, rows=[0])


def test_verify_rows_script_runs_on_model_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("verify_rows", ROOT / "eval" / "verify_rows.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "rows.json"
    assert script.main(["--model", "tiny", "--rows", "1,2", "--context", "8", "--repeats", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["rows"]) == {"1", "2"} and all(v["tree"] > 0 for v in data["rows"].values())
    assert "Verify cost vs rows: tiny" in capsys.readouterr().out
    assert script.main(["--model", "tiny", "--rows", "1,x"]) == 2
