"""How the float matmul reads the weights on this machine (selfspec/model/gemm_tuning.py): measured once, cached
beside the library, measured again when the cache does not match, or set by SELFSPEC_GEMM_PREFETCH and
SELFSPEC_GEMM_STREAM_ROWS."""

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
    """The session's library with its settings restored afterwards."""
    before = fl.gemm_stream_rows(), fl.gemm_prefetch_level()
    yield
    fl.gemm_stream_rows(before[0])
    fl.gemm_prefetch_level(before[1])


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    path = tmp_path / "gemm.json"
    monkeypatch.setattr(gt, "cache_path", lambda key, library: path)
    monkeypatch.delenv(gt.ENV_STREAM, raising=False)
    monkeypatch.delenv(gt.ENV_PREFETCH, raising=False)
    return path


def fake(stream_rows: int, level: int):
    return lambda kernels: {"stream_rows": stream_rows, "prefetch_level": level, "ms": {}}


def test_a_measurement_times_every_way_and_leaves_the_settings_alone(restored):
    fl.gemm_stream_rows(5)
    fl.gemm_prefetch_level(2)
    result = gt.measure_read_order(fl, megabytes=2, repeats=1)
    assert (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (5, 2)
    ms = result["ms"]
    assert set(ms) == set(range(1, 9)) and all(len(v) == 3 and min(v) > 0 for v in ms.values())
    level, n = result["prefetch_level"], result["stream_rows"]
    # L2 is chosen exactly when its blocks were faster by the margin over all row counts
    assert (level == 2) == (sum(v[1] for v in ms.values()) < gt.WIN * sum(v[0] for v in ms.values()))
    # stream_rows is the run of wins from one row up against the chosen blocks: every count up to it won, the next not
    assert 0 <= n <= 8
    assert all(ms[m][2] < gt.WIN * ms[m][level - 1] for m in range(1, n + 1))
    assert n == 8 or ms[n + 1][2] >= gt.WIN * ms[n + 1][level - 1]


def test_measured_once_then_read_from_the_cache(restored, own_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(gt, "measure_read_order", lambda kernels: calls.append(1) or fake(3, 2)(kernels))
    assert gt.apply_read_order(fl) == (3, 2) and (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (3, 2)
    data = json.loads(own_cache.read_text())
    assert (data["stream_rows"], data["prefetch_level"]) == (3, 2)
    assert {k: data[k] for k in gt.cache_key(fl)} == gt.cache_key(fl)
    fl.gemm_stream_rows(0)
    fl.gemm_prefetch_level(1)
    assert gt.apply_read_order(fl) == (3, 2) and (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (3, 2)
    assert len(calls) == 1  # the second time from the cache, no timing


@pytest.mark.parametrize("content", ["", "{not json", "[3]", '{"stream_rows": 99, "prefetch_level": 1}',
                                     '{"stream_rows": 2, "prefetch_level": 3}', '{"stream_rows": true, "prefetch_level": 1}',
                                     '{"stream_rows": 2}', "stale"])
def test_a_cache_that_does_not_match_is_measured_again(restored, own_cache, monkeypatch, content):
    key = gt.cache_key(fl)
    if content == "stale":
        content = json.dumps({**key, "library": "selfspec_kernels-000000000000.so", "stream_rows": 2, "prefetch_level": 1})
    elif content.startswith('{"stream_rows"'):
        content = json.dumps({**key, **json.loads(content)})
    own_cache.write_text(content)
    monkeypatch.setattr(gt, "measure_read_order", fake(6, 2))
    assert gt.apply_read_order(fl) == (6, 2)
    assert json.loads(own_cache.read_text())["stream_rows"] == 6


def test_the_environment_sets_them_and_nothing_is_measured(restored, own_cache, monkeypatch, caplog):
    monkeypatch.setattr(gt, "measure_read_order", lambda kernels: pytest.fail("measured although the environment set both"))
    monkeypatch.setenv(gt.ENV_STREAM, "2")
    monkeypatch.setenv(gt.ENV_PREFETCH, "1")
    assert gt.apply_read_order(fl) == (2, 1) and (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (2, 1)
    assert not own_cache.exists()
    # one set, the other measured; a bad value warns once and means auto
    monkeypatch.setattr(gt, "measure_read_order", fake(1, 2))
    monkeypatch.setenv(gt.ENV_PREFETCH, "l3")
    with caplog.at_level(logging.WARNING, logger=gt.__name__):
        assert gt.apply_read_order(fl) == (2, 2)
    (line,) = [r.getMessage() for r in caplog.records if r.name == gt.__name__]
    assert "SELFSPEC_GEMM_PREFETCH=l3: allowed auto or an integer from 1 to 2; using auto" in line


def test_a_cache_that_cannot_be_written_costs_nothing_but_time(restored, tmp_path, monkeypatch):
    (tmp_path / "missing-dir").write_text("a file where a folder should be")
    monkeypatch.setattr(gt, "cache_path", lambda key, library: tmp_path / "missing-dir" / "sub" / "gemm.json")
    monkeypatch.delenv(gt.ENV_STREAM, raising=False)
    monkeypatch.delenv(gt.ENV_PREFETCH, raising=False)
    monkeypatch.setattr(gt, "measure_read_order", fake(4, 1))
    assert gt.apply_read_order(fl) == (4, 1) and (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (4, 1)


def test_a_measurement_that_fails_leaves_the_kernels_working(tmp_path, monkeypatch, caplog):
    """Only speed is at stake: a measurement that raises costs one warning line and the default read order."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gt.ENV_STREAM, raising=False)
    monkeypatch.delenv(gt.ENV_PREFETCH, raising=False)
    for name in ("_kernel", "_layer_kernel", "_tree_layer_kernel", "_quant_kernel", "_isa_kernel", "_stream_kernel",
                 "_prefetch_kernel"):
        monkeypatch.setattr(fl, name, None)  # a process that has not loaded the kernels; restored afterwards

    def boom(kernels):
        raise MemoryError("no room for the weights")

    monkeypatch.setattr(gt, "measure_read_order", boom)
    with caplog.at_level(logging.WARNING, logger=fl.__name__):
        assert fl.load_kernel() is not None
    (line,) = [r.getMessage() for r in caplog.records if r.name == fl.__name__]
    assert line == "CPU kernels: could not measure the matmul's read order (no room for the weights); using the default"
    assert (fl.gemm_stream_rows(), fl.gemm_prefetch_level()) == (0, 1)
