"""What this machine is and how much of it is ours right now: the CPU's identity for result records, and the
thread count a decode should use on a machine that other processes share.

Why threads adapt. Our decode steps are OpenMP regions (torch's and our C kernels', one libgomp: the kernel library
is linked against the runtime torch already loaded, `openmp_runtimes`). A region splits its work evenly over its
threads and ends at a barrier, so it runs at the pace of its slowest thread. With one CPU-bound process beside a
2-thread decode on 2 cores, one of our threads shares its core with that process, and every region waits for it:
measured, each method kept about a quarter of its quiet speed, and not evenly across methods. With one thread per
core that is free, the OS gives that thread a core of its own, and a decode keeps about half its speed.

`probe_load` measures, while this process is idle, how many cores other processes keep busy (/proc/stat over a
short window, minus this process's own CPU time in it); `ThreadPolicy.adapt` turns that into a thread count and
sets it for torch and, through the shared runtime, for the C kernels. The evaluation adapts once per prompt,
before any method runs on it, so that every method of a prompt runs with the same threads.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# A thread of its own per free core; a second thread only when other processes leave it at least this much of a
# core (a core that is busy 30% of the time already costs a 2-thread region more than the thread gains).
SPARE_CORE = 0.7
PROBE_S = 0.1  # the window: 10 scheduler ticks per core at 100 Hz
# The thread count this process started with (torch's default: the physical cores, or OMP_NUM_THREADS): the most
# that "auto" uses, whatever an earlier adaptation in this process set.
START_THREADS = torch.get_num_threads()
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8",
             "amx_bf16")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's cpuset shows here)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpuinfo() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (empty off Linux)."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return out
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def cpu_identity() -> dict:
    """The CPU as a result record names it: model name, vendor, family and model number, the instruction-set
    flags that decide which kernels run, and the cores this process may use."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "model_name": info.get("model name") or platform.processor() or "unknown",
        "vendor": info.get("vendor_id", "unknown"),
        "family": _int_or_none(info.get("cpu family")),
        "model": _int_or_none(info.get("model")),
        "flags": [f for f in CPU_FLAGS if f in flags],
        "cores": usable_cores(),
        "machine": platform.machine(),
    }


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def software() -> dict:
    """torch's version, its BLAS as torch reports it, the thread count this process started with, and the GPU
    when there is one."""
    config = torch.__config__.show()
    blas = next((line.split("=", 1)[1].strip() for line in config.splitlines() if "BLAS_INFO" in line), None)
    mkl = next((line.strip().lstrip("- ") for line in config.splitlines() if "Math Kernel Library" in line), None)
    out = {"torch": torch.__version__, "blas": mkl or blas or "unknown", "python": platform.python_version(),
           "threads": START_THREADS}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere). One entry means torch and the C
    kernels share one thread pool and one thread count."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if len(line.split()) >= 6}
    return sorted(p for p in paths if any(n in Path(p).name for n in ("libgomp", "libiomp", "libomp")))


# ------------------------------------------------------------------------------------------------ load
def _usable_cpu_ids() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _cpu_jiffies(cpus: set[int] | None) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over the CPUs in `cpus` (None: the machine-wide line) from /proc/stat, or None
    where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return None
    if cpus is None:
        rows = [f for f in lines if f[0] == "cpu"]
    else:
        rows = [f for f in lines if f[0] != "cpu" and f[0][3:].isdigit() and int(f[0][3:]) in cpus]
    if not rows:
        return None
    busy = total = 0
    for fields in rows:
        values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return busy, total


@dataclass(frozen=True)
class Load:
    """What a probe saw: `others` cores kept busy by other processes (0..cores), on `cores` usable cores."""

    others: float
    cores: int

    @property
    def free(self) -> float:
        return max(0.0, self.cores - self.others)


def probe_load(window_s: float = PROBE_S) -> Load | None:
    """How many of this process's usable cores other processes keep busy, measured over `window_s` while this
    process sleeps (its own CPU time in the window, such as OpenMP threads still spinning, is subtracted). Counts
    only the CPUs in this process's affinity mask. None where /proc/stat is missing."""
    cpus = _usable_cpu_ids()
    a, own_a = _cpu_jiffies(cpus), os.times()
    if a is None:
        return None
    time.sleep(window_s)
    b, own_b = _cpu_jiffies(cpus), os.times()
    if b is None or b[1] <= a[1]:
        return None
    cores = len(cpus) if cpus else usable_cores()
    busy_cores = (b[0] - a[0]) / (b[1] - a[1]) * cores
    own = ((own_b.user - own_a.user) + (own_b.system - own_a.system)) / max(own_b.elapsed - own_a.elapsed, 1e-9)
    return Load(others=min(float(cores), max(0.0, busy_cores - own)), cores=cores)


def threads_for(load: Load, limit: int) -> int:
    """The thread count for a machine with this load: one per core with at least SPARE_CORE of it free, at least
    1 and at most `limit`."""
    return max(1, min(limit, math.floor(load.free + (1 - SPARE_CORE))))


# ------------------------------------------------------------------------------------------------ the policy
@dataclass
class ThreadChoice:
    """One adaptation: the threads chosen, out of `limit`, and the load that chose them (None: not measured)."""

    threads: int
    limit: int
    load: Load | None

    @property
    def busy(self) -> bool:
        """Other processes took at least one core's worth of what this decode would have used."""
        return self.threads < self.limit

    def as_dict(self) -> dict:
        out = {"threads": self.threads, "limit": self.limit, "busy": self.busy}
        if self.load is not None:
            out.update(other_load_cores=round(self.load.others, 2), cores=self.load.cores)
        return out


class ThreadPolicy:
    """`threads="auto"`: before each unit of work, as many threads as the machine has free cores, at most the
    thread count this process started with (torch's default: the physical cores, or OMP_NUM_THREADS). An integer:
    that many, always. Sets torch's count, which the C kernels share (one OpenMP runtime)."""

    def __init__(self, threads: int | str = "auto"):
        if threads != "auto" and not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
            raise ValueError(f"threads={threads!r}: must be 'auto' or an integer >= 1")
        self.threads = threads
        self.limit = START_THREADS if threads == "auto" else int(threads)
        self.history: list[ThreadChoice] = []

    def adapt(self) -> ThreadChoice:
        load = probe_load() if self.threads == "auto" and self.limit > 1 else None
        n = threads_for(load, self.limit) if load is not None else self.limit
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        choice = ThreadChoice(n, self.limit, load)
        self.history.append(choice)
        return choice

    def summary(self) -> dict:
        """Over every adaptation so far: how many found the machine busy, the mean load seen, the threads used."""
        loads = [c.load.others for c in self.history if c.load is not None]
        busy = [c.load.others for c in self.history if c.busy and c.load is not None]
        return {
            "policy": self.threads, "limit": self.limit, "adaptations": len(self.history),
            "busy": sum(c.busy for c in self.history),
            "mean_other_load_cores": round(sum(loads) / len(loads), 2) if loads else None,
            "busy_other_load_cores": round(sum(busy) / len(busy), 2) if busy else None,  # over the busy prompts
            "threads_used": sorted({c.threads for c in self.history}),
        }
