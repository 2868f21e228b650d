"""How the AVX-512 float matmul reads the weights on this machine (selfspec/model/gemm_tuning.py): measured once,
cached beside the library, re-measured when the cache does not match, or set by SELFSPEC_GEMM_STREAM_ROWS."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from selfspec.model import cpu_kernels as fl
from selfspec.model import gemm_tuning as gt

HAS_KERNEL_PREREQS = fl._cpu_has_avx2_fma() and bool(shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAS_KERNEL_PREREQS, reason="the kernel needs an x86-64 CPU with AVX2/FMA and a C compiler")


@pytest.fixture
def restored():
    """The session's library with its setting restored afterwards."""
    before = fl.gemm_stream_rows()
    yield
    fl.gemm_stream_rows(before)


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    path = tmp_path / "gemm.json"
    monkeypatch.setattr(gt, "cache_path", lambda key: path)
    monkeypatch.delenv(gt.ENV, raising=False)
    return path


def test_a_measurement_times_both_ways_and_leaves_the_setting_alone(restored):
    fl.gemm_stream_rows(5)
    result = gt.measure_stream_rows(megabytes=2, repeats=1)
    assert fl.gemm_stream_rows() == 5
    assert set(result["ms"]) == set(range(1, 9))
    assert all(len(v) == 2 and min(v) > 0 for v in result["ms"].values())
    n = result["stream_rows"]
    assert isinstance(n, int) and 0 <= n <= 8
    # the chosen count is the run of wins from one row up: every count up to it won, the next one did not
    assert all(result["ms"][m][1] < gt.WIN * result["ms"][m][0] for m in range(1, n + 1))
    assert n == 8 or result["ms"][n + 1][1] >= gt.WIN * result["ms"][n + 1][0]


def test_measured_once_then_read_from_the_cache(restored, own_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(gt, "measure_stream_rows", lambda: calls.append(1) or {"stream_rows": 3, "ms": {}})
    assert gt.apply_stream_rows() == 3 and fl.gemm_stream_rows() == 3 and len(calls) == 1
    data = json.loads(own_cache.read_text())
    assert data["stream_rows"] == 3 and {k: data[k] for k in gt.cache_key()} == gt.cache_key()
    fl.gemm_stream_rows(0)
    assert gt.apply_stream_rows() == 3 and fl.gemm_stream_rows() == 3 and len(calls) == 1  # the cache, no timing


@pytest.mark.parametrize("content", ["", "{not json", "[3]", '{"stream_rows": 99}', "stale", '{"stream_rows": true}'])
def test_a_cache_that_does_not_match_is_measured_again(restored, own_cache, monkeypatch, content):
    key = gt.cache_key()
    if content == "stale":
        content = json.dumps({**key, "library": "selfspec_kernels-000000000000.so", "stream_rows": 2})
    elif content.startswith('{"stream_rows"'):
        content = json.dumps({**key, **json.loads(content)})
    own_cache.write_text(content)
    monkeypatch.setattr(gt, "measure_stream_rows", lambda: {"stream_rows": 6, "ms": {}})
    assert gt.apply_stream_rows() == 6
    assert json.loads(own_cache.read_text())["stream_rows"] == 6


def test_the_environment_sets_it_and_nothing_is_measured(restored, own_cache, monkeypatch, caplog):
    monkeypatch.setattr(gt, "measure_stream_rows", lambda: pytest.fail("measured although the environment set it"))
    monkeypatch.setenv(gt.ENV, "2")
    assert gt.apply_stream_rows() == 2 and fl.gemm_stream_rows() == 2
    assert not own_cache.exists()
    monkeypatch.setenv(gt.ENV, "lots")
    monkeypatch.setattr(gt, "measure_stream_rows", lambda: {"stream_rows": 1, "ms": {}})
    with caplog.at_level(logging.WARNING, logger=gt.__name__):
        assert gt.apply_stream_rows() == 1  # a bad value: one warning, then auto
    (line,) = [r.getMessage() for r in caplog.records if r.name == gt.__name__]
    assert "SELFSPEC_GEMM_STREAM_ROWS=lots: allowed auto or an integer from 0 to 8" in line


def test_a_cache_that_cannot_be_written_costs_nothing_but_time(restored, tmp_path, monkeypatch):
    target = tmp_path / "missing-dir" / "sub" / "gemm.json"
    (tmp_path / "missing-dir").write_text("a file where a folder should be")
    monkeypatch.setattr(gt, "cache_path", lambda key: target)
    monkeypatch.delenv(gt.ENV, raising=False)
    monkeypatch.setattr(gt, "measure_stream_rows", lambda: {"stream_rows": 4, "ms": {}})
    assert gt.apply_stream_rows() == 4 and fl.gemm_stream_rows() == 4
