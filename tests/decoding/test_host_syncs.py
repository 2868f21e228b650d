"""Greedy chain decoding reads the device back to the host at most once per round (issue 23, item 4).

Every Python-level way a tensor's value reaches the host is counted: item, tolist, int/float/bool/index of a
tensor, cpu, numpy, nonzero, and indexing with a 0-d integer tensor (torch reads such an index back with item()).
The count runs between the start of one round's `draft` and the next one's, so `start` (the prompt's checks) and
`finish` are outside it. On CUDA (SELFSPEC_TEST_DEVICE=cuda, eval/gpu_check.sh) torch's own sync debug mode
counts the synchronizations the C++ side makes as well.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.engine import Decoder
from selfspec.decoding.state import Timer as _Timer
from selfspec.decoding.stats import DecodeStats

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero")


class SyncCounter:
    """Counts host reads of tensors, bucketed into rounds (a new bucket at each proposal)."""

    def __init__(self):
        self.rounds: list[int] = []
        self.active = False

    def hit(self) -> None:
        if self.active and self.rounds:
            self.rounds[-1] += 1

    @contextlib.contextmanager
    def counting(self, monkeypatch):
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, __original=original, **kwargs):
                self.hit()
                return __original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, wrapper)
        # Not patched: __getitem__ / __setitem__ (a 0-d integer tensor index is also a read). Assigning them on
        # torch.Tensor, even once and undone, leaves the class with Python sequence slots: torch.tensor([0-d tensors])
        # then fails in every later test of the session. On CUDA, torch's sync debug mode (cuda_sync_warnings) sees
        # those reads.
        start = Decoder.start

        def started(decoder, *args, **kwargs):  # a new bucket at each of this generation's proposals
            state = start(decoder, *args, **kwargs)
            propose = state.proposer.propose

            def new_round(st):
                self.rounds.append(0)
                return propose(st)

            state.proposer.propose = new_round
            return state

        monkeypatch.setattr(Decoder, "start", started)
        finish = Decoder.finish

        def stop(decoder, state):
            self.active = False  # finish's own read (the timer's one wait on CUDA) is not a round's
            return finish(decoder, state)

        monkeypatch.setattr(Decoder, "finish", stop)
        self.active = True
        try:
            yield self
        finally:
            self.active = False


@contextlib.contextmanager
def cuda_sync_warnings(device):
    """On CUDA: torch's sync debug mode warns at every synchronizing call; yields the list of warnings."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("head_type,draft_vocab", [("lens", None), ("medusa", 200), ("adapter", None), ("lora", None)])
def test_greedy_chain_reads_the_device_once_per_round(head_type, draft_vocab, monkeypatch):
    m = make_tiny("llama")
    m.set_head(head_type, exit_layer=2, draft_vocab=draft_vocab)
    randomize_head(m.head, seed=3, std=0.05 if head_type == "lora" else 0.2)
    ids = m.encode("Once upon a time, in a land far away,")
    cfg = DecodeConfig(draft_len=4, max_new_tokens=40)
    ref = m.decoder.decode(ids, DecodeConfig(strategy="autoregressive", max_new_tokens=40))
    counter = SyncCounter()
    with cuda_sync_warnings(m.backbone.device) as cuda_warnings, counter.counting(monkeypatch):
        got = m.decoder.decode(ids, cfg)
    monkeypatch.undo()
    assert got.token_ids == ref.token_ids  # still the target's own greedy output
    rounds = got.stats.verify_steps
    assert len(counter.rounds) == rounds and rounds > 3
    assert 0 < got.stats.accepted < got.stats.drafted  # both branches of the accept step ran
    assert max(counter.rounds) == 1, counter.rounds  # exactly one read per round, never more
    if cuda_warnings is not None:  # the device's own count: the rounds' reads plus start's and finish's few
        syncs = [w for w in cuda_warnings if "synchroniz" in str(w.message)]
        assert len(syncs) <= rounds + 8, (len(syncs), rounds, sorted({f"{w.filename}:{w.lineno}" for w in syncs}))


def test_the_count_sees_a_read_per_draft(monkeypatch):
    """The counter has power: the old draft step (int(argmax) per draft) is counted once per draft."""
    import selfspec.decoding.proposers.chains as chains

    def old_pick(logits, cfg, generator):
        return int(logits.argmax()), None, 1.0

    m = make_tiny("llama")
    m.set_head("lens", exit_layer=2)
    ids = m.encode("Once upon a time")
    counter = SyncCounter()
    monkeypatch.setattr(chains, "pick", old_pick)
    with counter.counting(monkeypatch):
        got = m.decoder.decode(ids, DecodeConfig(draft_len=4, max_new_tokens=20, fused_chain=False))  # pass by pass
    monkeypatch.undo()
    assert got.stats.drafted > 0 and max(counter.rounds) >= 5  # 4 drafts + the round's own read


def test_eos_and_stop_strings_need_no_extra_read(monkeypatch, tiny_llama):
    """The EOS check and a stop rule (stop_fn over the new ids) work on the round's one read: the host copy of the
    new tokens."""
    m = tiny_llama
    m.set_head("lens", exit_layer=2)
    ids = m.encode("The quick brown fox")
    cfg = DecodeConfig(draft_len=3, max_new_tokens=30)
    full = m.decoder.decode(ids, cfg).token_ids
    eos, pair = full[7], full[11:13]
    calls = []

    def stop_fn(new: list[int]) -> int | None:  # stop after the first occurrence of `pair`, as stop strings do
        calls.append(list(new))
        hit = next((i for i in range(len(new) - 1) if new[i : i + 2] == pair), None)
        return None if hit is None else hit + 2

    counter = SyncCounter()
    with counter.counting(monkeypatch):
        cut = m.decoder.decode(ids, cfg, eos_ids=[eos])
        stopped = m.decoder.decode(ids, cfg, stop_fn=stop_fn)
    monkeypatch.undo()
    assert cut.token_ids == full[: full.index(eos) + 1]
    first = next(i for i in range(len(full) - 1) if full[i : i + 2] == pair)
    assert stopped.token_ids == full[: first + 2]
    assert all(c == full[: len(c)] for c in calls)  # stop_fn saw exactly the committed tokens each round
    assert max(counter.rounds) == 1, counter.rounds


class FakeEvent:
    """torch.cuda.Event on a CPU machine: records a clock reading; elapsed_time in milliseconds."""

    clock = 0.0
    waits = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = FakeEvent.clock

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000


def test_cuda_timer_records_events_and_waits_once_at_the_end(monkeypatch):
    """On CUDA the draft / verify split comes from events: lap() never synchronizes, settle() waits once."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the loop synchronized"))
    FakeEvent.clock, FakeEvent.waits = 0.0, 0
    timer, stats = _Timer(torch.device("cuda")), DecodeStats()
    for draft, verify in ((0.5, 1.0), (0.25, 2.0)):
        FakeEvent.clock += draft
        timer.lap(stats, "draft_s")
        FakeEvent.clock += verify
        timer.lap(stats, "verify_s")
    assert stats.draft_s == 0 and stats.verify_s == 0 and FakeEvent.waits == 0  # nothing read in the loop
    timer.settle(stats)
    assert FakeEvent.waits == 1 and stats.draft_s == pytest.approx(0.75) and stats.verify_s == pytest.approx(3.0)
    timer.settle(stats)  # settled phases are not counted twice
    assert FakeEvent.waits == 1 and stats.verify_s == pytest.approx(3.0)


def test_cpu_timer_adds_wall_clock_at_each_lap():
    timer, stats = _Timer(torch.device("cpu")), DecodeStats()
    timer.lap(stats, "draft_s")
    timer.lap(stats, "verify_s")
    timer.settle(stats)
    assert stats.draft_s >= 0 and stats.verify_s >= 0 and not timer.marks
