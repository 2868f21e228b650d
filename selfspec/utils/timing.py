"""Timing several ways of decoding the same prompts fairly: the one harness behind `python -m selfspec.eval`
and training's validation (which pool the stats of the calls with decoding/stats.py: pool_stats).

Every method runs on a prompt before the next prompt starts, so slow drift (thermal throttling, other load on
a shared machine) hits all methods alike: a baseline timed minutes apart from the method it is compared with
turns that drift into a fake speedup (measured here once: 2.0x for a head whose interleaved speedup is below
1). The order of the methods rotates from prompt to prompt, so that none is always first after a switch.
Before timing starts, one untimed short call per method pays the first-call costs (allocator growth, lazy
initialisation, kernel compilation) that would otherwise land on whichever method runs first.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


# ------------------------------------------------------------------------------------------------ clocks
def sync(device: torch.device) -> None:
    """Wait for queued CUDA work, so that a clock read after it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], R], device: torch.device) -> tuple[R, float]:
    """(fn(), wall seconds of the whole call), synchronised on CUDA before and after."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset (per call). CPU: the process's max RSS so far, which is
    process-wide and monotonic, so on CPU it is the same for every method of one run."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


# ------------------------------------------------------------------------------------------------ the harness
def rotation(names: Sequence[str], index: int) -> list[str]:
    """The order in which the methods run on item `index`: `names` rotated left by index."""
    k = index % len(names)
    return list(names[k:]) + list(names[:k])


def run_interleaved(
    runs: Mapping[str, Callable[[T], R]],
    items: Sequence[T],
    warmup: Callable[[str], object] | None = None,
    on_result: Callable[[str, int, R], None] | None = None,
    before_item: Callable[[int], object] | None = None,
) -> list[dict[str, R]]:
    """Every method on every item, item by item, in rotating order.

    runs: name -> call(item) -> result (the call times itself). warmup(name): one untimed call per method
    before the first item. before_item(item index): untimed, before any method runs on the item (the thread
    count adapts to the machine's load there, utils/machine.py, so that all methods of an item run alike).
    on_result(name, item index, result) after each call (to stream results).
    -> one dict per item, name -> result, in the order the methods ran on it."""
    names = list(runs)
    if warmup is not None:
        for name in names:
            warmup(name)
    out = []
    for i, item in enumerate(items):
        if before_item is not None:
            before_item(i)
        results: dict[str, R] = {}
        for name in rotation(names, i):
            results[name] = runs[name](item)
            if on_result is not None:
                on_result(name, i, results[name])
        out.append(results)
    return out
