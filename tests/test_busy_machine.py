"""A machine that other processes share (issue 58, item 1): the load is measured, the thread count follows it,
torch and the C kernels share one OpenMP runtime, and an eval on a busy machine says so."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import pytest
import torch

from selfspec.utils import machine
from selfspec.utils.machine import Load, ThreadChoice, ThreadPolicy, threads_for


def test_threads_follow_the_free_cores():
    assert threads_for(Load(others=0.0, cores=2), limit=2) == 2
    assert threads_for(Load(others=0.1, cores=2), limit=2) == 2
    assert threads_for(Load(others=1.0, cores=2), limit=2) == 1  # one core taken: one thread
    assert threads_for(Load(others=0.5, cores=2), limit=2) == 1  # half a core taken: a second thread waits on it
    assert threads_for(Load(others=2.0, cores=2), limit=2) == 1  # never below one
    assert threads_for(Load(others=1.0, cores=8), limit=4) == 4  # never above the limit
    assert threads_for(Load(others=5.4, cores=8), limit=8) == 2  # 2.6 free: the third core is 60% free


def test_a_cpu_bound_process_is_seen_and_the_policy_takes_one_thread_less(monkeypatch):
    quiet = machine.probe_load()
    if quiet is None:
        pytest.fail("/proc/stat is not readable on this Linux test machine")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = machine.probe_load(window_s=0.3)
        monkeypatch.setattr(machine, "START_THREADS", 2)
        before = torch.get_num_threads()
        try:
            choice = ThreadPolicy("auto").adapt()
        finally:
            torch.set_num_threads(before)
    finally:
        hog.kill()
        hog.wait()
    assert busy is not None and busy.others >= 0.6, busy  # the hog holds about one core
    assert busy.others >= quiet.others + 0.5
    assert choice.threads == 1 and choice.busy and choice.load.others >= 0.6


def test_our_own_threads_are_not_counted_as_other_load():
    # A thread of this process spinning through the window is this process's CPU time, subtracted.
    import threading

    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        load = machine.probe_load(window_s=0.3)
    finally:
        stop.set()
        t.join()
    assert load is not None and load.others < 0.5, load


def test_a_fixed_count_is_kept_and_bad_counts_are_refused():
    before = torch.get_num_threads()
    try:
        choice = ThreadPolicy(1).adapt()
        assert (choice.threads, choice.load, torch.get_num_threads()) == (1, None, 1)
    finally:
        torch.set_num_threads(before)
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match="threads="):
            ThreadPolicy(bad)


def test_torch_and_the_c_kernels_share_one_openmp_runtime():
    from selfspec.model import cpu_kernels

    if not cpu_kernels.load_kernel():
        pytest.fail("the C kernels did not load on this x86 test machine")
    runtimes = machine.openmp_runtimes()
    assert len(runtimes) == 1, runtimes  # two runtimes would mean two thread pools spinning against each other
    omp = ctypes.CDLL(runtimes[0])  # the already-loaded runtime, as the kernels see it
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert omp.omp_get_max_threads() == 1  # what the policy sets reaches the kernels' parallel regions
        torch.set_num_threads(2)
        assert omp.omp_get_max_threads() == 2
    finally:
        torch.set_num_threads(before)


class _Policy:
    """Stands in for ThreadPolicy: a scripted load per item."""

    def __init__(self, threads_per_item):
        self.script = list(threads_per_item)
        self.calls = 0

    def adapt(self):
        n = self.script[self.calls]
        self.calls += 1
        return ThreadChoice(n, 2, Load(others=2.0 - n, cores=2))


def test_the_eval_adapts_before_each_prompt_and_every_method_of_a_prompt_notes_the_same_threads():
    from types import SimpleNamespace

    from selfspec.decoding.config import DecodeConfig
    from selfspec.evaluation.runner import Renderer, build_methods, run_eval

    from conftest import make_tiny

    m = make_tiny("llama", head="lens", exit_layer=2)
    methods = build_methods(["autoregressive", "selfspec"], m, DecodeConfig(max_new_tokens=4, draft_len=2),
                            head=m.head)
    items = [SimpleNamespace(id=i, category="c", turns=[f"prompt {i}"]) for i in range(3)]
    policy = _Policy([2, 1, 2])
    records = run_eval(methods, items, Renderer(m.tokenizer, chat=False), 4, torch.device("cpu"), warmup=False,
                       threads=policy)
    assert policy.calls == 3
    by_prompt = {}
    for rec in records:
        by_prompt.setdefault(rec["prompt_id"], set()).add(rec["threads"]["threads"])
    assert by_prompt == {0: {2}, 1: {1}, 2: {2}}
    assert all(rec["threads"]["busy"] == (rec["threads"]["threads"] == 1) for rec in records)


def test_summary_md_says_the_machine_was_busy():
    from selfspec.cli.eval import _busy_line

    assert _busy_line({"busy": 0, "adaptations": 4}) is None
    line = _busy_line({"busy": 3, "adaptations": 4, "mean_other_load_cores": 0.8, "limit": 2, "threads_used": [1, 2]})
    assert "busy machine" in line and "3 of 4 prompts" in line and "0.8 cores" in line
