"""Which way the float matmul reads the weights on this machine, measured once and cached.

kernels/small_gemm.c can walk a weight matrix in blocks of rows read side by side with a software prefetch (tuned
on a Xeon), or one row at a time front to back, which the hardware prefetcher follows (on a 2-core AMD EPYC, Zen 4,
25-35% faster for 1-4 input rows, slower from 7). Both give the very same sums, so the choice is only about speed,
and it depends on the CPU: `measure_stream_rows` times both on weights larger than the caches for 1..8 input rows,
interleaved, and `gemm_stream_rows` is the largest row count up to which streaming won every time.

The measurement (about a second) runs on a process's first use of the kernels when no cached one applies, and is
written beside the library (`<library>-gemm-<hash>.json`, keyed by the library, the CPU model, the instruction set
and the thread count). A cached file that does not parse or does not match is measured again. SELFSPEC_GEMM_STREAM_ROWS=0..8 sets
the value and measures nothing ("auto", the default, takes the measured one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from selfspec.model import cpu_kernels

log = logging.getLogger(__name__)

ENV = "SELFSPEC_GEMM_STREAM_ROWS"
MAX_ROWS = 8  # the stream blocks exist for 1..8 input rows
WIN = 0.97  # streaming must take under 97% of the blocks' median time to count as a win


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cache_key() -> dict:
    """What a measurement holds for: this library build, this CPU model, instruction set and thread count."""
    return {"library": cpu_kernels.library_path().name, "cpu": _cpu_model(), "isa": cpu_kernels.gemm_isa(),
            "threads": torch.get_num_threads()}


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    lib = cpu_kernels.library_path()
    return lib.with_name(f"{lib.stem}-gemm-{digest}.json")


def read_cached(path: Path, key: dict) -> int | None:
    """The cached stream_rows for `key`, or None when the file is absent, unreadable or for something else."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in key.items()):
        return None
    n = data.get("stream_rows")
    return n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_ROWS else None


def measure_stream_rows(megabytes: int = 96, repeats: int = 7, n: int = 3072, k: int = 576) -> dict:
    """Time the matmul with the weights read in blocks and row by row, for 1..8 input rows, interleaved pass by pass
    over `megabytes` of float32 (n, k) weights -> {"stream_rows": chosen, "ms": {rows: [blocks, streamed]}}.
    Leaves the setting as it found it."""
    copies = max(1, megabytes * 2**20 // (n * k * 4))
    g = torch.Generator().manual_seed(0)
    weights = [torch.empty(n, k, dtype=torch.float32).uniform_(-1, 1, generator=g) for _ in range(copies)]
    x = torch.randn(MAX_ROWS, k, generator=g, dtype=torch.float32)
    before = cpu_kernels.gemm_stream_rows()
    times: dict[int, tuple[list[float], list[float]]] = {m: ([], []) for m in range(1, MAX_ROWS + 1)}
    try:
        for _ in range(repeats):
            for m, (blocks, streamed) in times.items():
                for setting, out in ((0, blocks), (m, streamed)):
                    cpu_kernels.gemm_stream_rows(setting)
                    t = time.perf_counter()
                    for w in weights:
                        cpu_kernels.linear(x[:m], w)
                    out.append(time.perf_counter() - t)
    finally:
        cpu_kernels.gemm_stream_rows(before)
    ms = {m: [statistics.median(b) * 1e3 / copies, statistics.median(s) * 1e3 / copies] for m, (b, s) in times.items()}
    chosen = 0
    for m in range(1, MAX_ROWS + 1):
        if ms[m][1] >= WIN * ms[m][0]:
            break
        chosen = m
    return {"stream_rows": chosen, "ms": ms}


def _from_env() -> int | None:
    """SELFSPEC_GEMM_STREAM_ROWS as an int, None for auto (a bad value warns once and means auto)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value == "auto":
        return None
    if value.isdigit() and 0 <= int(value) <= MAX_ROWS:
        return int(value)
    log.warning("%s=%s: allowed auto or an integer from 0 to %d; using auto", ENV, value, MAX_ROWS)
    return None


def apply_stream_rows() -> int:
    """Set the kernels' stream_rows for this process (called once the library is loaded) -> the value set."""
    n = _from_env()
    if n is None:
        key = cache_key()
        path = cache_path(key)
        n = read_cached(path, key)
        if n is None:
            result = measure_stream_rows()
            n = result["stream_rows"]
            log.info("CPU kernels: weights read row by row up to %d input rows (measured on %s, %s, %d threads)", n,
                     key["cpu"], key["isa"], key["threads"])
            _write(path, {**key, **result})
    cpu_kernels.gemm_stream_rows(n)
    return n


def _write(path: Path, payload: dict) -> None:
    from selfspec.utils.io import atomic_write_json

    try:
        atomic_write_json(path, payload)
    except OSError as exc:  # a read-only cache: measured again next time, nothing else lost
        log.info("CPU kernels: could not cache the measured setting in %s (%s)", path, exc.strerror or exc)
