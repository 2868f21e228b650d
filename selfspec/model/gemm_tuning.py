"""How the float matmul reads the weights on this machine, measured once and cached.

kernels/small_gemm.c walks a weight matrix in blocks of rows read side by side, prefetching what it reads next into
L1 (tuned on a Xeon) or into L2 only, or, for calls of up to `stream_rows` input rows, one weight row at a time
front to back with no software prefetch, which the hardware prefetcher follows. All of them give the very same
sums, so the choice is only about speed, and it depends on the CPU. On a 2-core AMD EPYC (Zen 4), prefetching into
L1 left a multi-row call's reads and FMAs serialized; into L2, 2-8 rows cost about what one row costs.

`measure_read_order` times the three ways on weights larger than the caches for 1..8 input rows, interleaved, and
chooses the prefetch level that is faster over all row counts (L2 must win by 3%), then `stream_rows` = the largest
row count up to which reading row by row beat those blocks every time (by 3%).

The measurement (about two seconds) runs on a process's first use of the kernels when no cached one applies, and is
written beside the library (`<library>-gemm-<hash>.json`, keyed by the library, the CPU model, the instruction set
and the thread count). A cached file that does not parse or does not match is measured again.
SELFSPEC_GEMM_PREFETCH=1|2 and SELFSPEC_GEMM_STREAM_ROWS=0..8 set the two values ("auto", the default, takes the
measured one); when both are set, nothing is measured.

Every function here is handed the kernels it tunes (`Kernels`: model/cpu_kernels.py passes itself once its library
is loaded), so this module sits below cpu_kernels.py and imports nothing of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Protocol

import torch

from selfspec.utils.io import atomic_write_json

log = logging.getLogger(__name__)

ENV_STREAM, ENV_PREFETCH = "SELFSPEC_GEMM_STREAM_ROWS", "SELFSPEC_GEMM_PREFETCH"
MAX_ROWS = 8  # the stream blocks exist for 1..8 input rows
WIN = 0.97  # a way must take under 97% of the other's median time to count as a win
WAYS = ("blocks, L1", "blocks, L2", "row by row")  # the columns of a measurement's "ms"


class Kernels(Protocol):
    """What the tuning reads and sets of the compiled kernels (model/cpu_kernels.py, the module itself)."""

    def library_path(self) -> Path: ...

    def gemm_isa(self, want: str | None = None) -> str | None: ...

    def gemm_stream_rows(self, want: int | None = None) -> int | None: ...

    def gemm_prefetch_level(self, want: int | None = None) -> int | None: ...

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def cache_key(kernels: Kernels) -> dict:
    """What a measurement holds for: this library build, this CPU model, instruction set and thread count."""
    return {"library": kernels.library_path().name, "cpu": _cpu_model(), "isa": kernels.gemm_isa(),
            "threads": torch.get_num_threads()}


def cache_path(key: dict, library: Path) -> Path:
    """Where the measurement for `key` is cached: beside `library`, named by the key's digest."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return library.with_name(f"{library.stem}-gemm-{digest}.json")


def _int_in(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def read_cached(path: Path, key: dict) -> tuple[int, int] | None:
    """The cached (stream_rows, prefetch_level) for `key`, or None when the file is absent, unreadable or for
    something else."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in key.items()):
        return None
    n, level = data.get("stream_rows"), data.get("prefetch_level")
    return (n, level) if _int_in(n, 0, MAX_ROWS) and _int_in(level, 1, 2) else None


def _time_ways(kernels: Kernels, weights: list, x: torch.Tensor, repeats: int) -> dict[int, list[list[float]]]:
    """{rows: [seconds per pass of each way in WAYS]}, the ways alternating pass by pass."""
    times = {m: [[], [], []] for m in range(1, MAX_ROWS + 1)}
    for _ in range(repeats):
        for m, per_way in times.items():
            for (stream, level), out in zip(((0, 1), (0, 2), (m, 1)), per_way):
                kernels.gemm_stream_rows(stream)
                kernels.gemm_prefetch_level(level)
                t = time.perf_counter()
                for w in weights:
                    kernels.linear(x[:m], w)
                out.append(time.perf_counter() - t)
    return times


def measure_read_order(kernels: Kernels, megabytes: int = 96, repeats: int = 7, n: int = 3072, k: int = 576) -> dict:
    """Time the three ways of reading the weights for 1..8 input rows over `megabytes` of float32 (n, k) weights ->
    {"stream_rows", "prefetch_level", "ms": {rows: [ms per matmul for each way in WAYS]}}. Leaves the settings as
    it found them."""
    copies = max(1, megabytes * 2**20 // (n * k * 4))
    g = torch.Generator().manual_seed(0)
    weights = [torch.empty(n, k, dtype=torch.float32).uniform_(-1, 1, generator=g) for _ in range(copies)]
    x = torch.randn(MAX_ROWS, k, generator=g, dtype=torch.float32)
    before = kernels.gemm_stream_rows(), kernels.gemm_prefetch_level()
    try:
        times = _time_ways(kernels, weights, x, repeats)
    finally:
        kernels.gemm_stream_rows(before[0])
        kernels.gemm_prefetch_level(before[1])
    ms = {m: [statistics.median(t) * 1e3 / copies for t in per_way] for m, per_way in times.items()}
    l1, l2 = sum(v[0] for v in ms.values()), sum(v[1] for v in ms.values())
    level = 2 if l2 < WIN * l1 else 1
    stream_rows = 0
    for m in range(1, MAX_ROWS + 1):
        if ms[m][2] >= WIN * ms[m][level - 1]:
            break
        stream_rows = m
    return {"stream_rows": stream_rows, "prefetch_level": level, "ways": list(WAYS), "ms": ms}


def _from_env(name: str, allowed: range) -> int | None:
    """An environment setting as an int, None for auto (a bad value warns and means auto)."""
    value = os.environ.get(name, "auto").strip().lower()
    if value == "auto":
        return None
    if value.isdigit() and int(value) in allowed:
        return int(value)
    log.warning("%s=%s: allowed auto or an integer from %d to %d; using auto", name, value, allowed[0], allowed[-1])
    return None


def apply_read_order(kernels: Kernels) -> tuple[int, int]:
    """Set the kernels' stream_rows and prefetch level for this process (called once the library is loaded) ->
    the (stream_rows, prefetch_level) set."""
    n, level = _from_env(ENV_STREAM, range(0, MAX_ROWS + 1)), _from_env(ENV_PREFETCH, range(1, 3))
    if n is None or level is None:
        key = cache_key(kernels)
        path = cache_path(key, kernels.library_path())
        cached = read_cached(path, key)
        if cached is None:
            result = measure_read_order(kernels)
            cached = result["stream_rows"], result["prefetch_level"]
            log.info("CPU kernels: blocks prefetch into L%d, weights read row by row up to %d input rows (measured "
                     "on %s, %s, %d threads)", cached[1], cached[0], key["cpu"], key["isa"], key["threads"])
            _write(path, {**key, **result})
        n = cached[0] if n is None else n
        level = cached[1] if level is None else level
    kernels.gemm_stream_rows(n)
    kernels.gemm_prefetch_level(level)
    return n, level


def _write(path: Path, payload: dict) -> None:
    try:
        atomic_write_json(path, payload)
    except OSError as exc:  # a read-only cache: measured again next time, nothing else lost
        log.info("CPU kernels: could not cache the measured setting in %s (%s)", path, exc.strerror or exc)
