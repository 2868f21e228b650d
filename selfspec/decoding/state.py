"""What one generation holds between rounds (`DecodeState`), what it returns (`DecodeResult`), and its clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.decoding.config import DecodeConfig
from selfspec.decoding.stats import DecodeStats
from selfspec.model.cache import KVCache

StopFn = Callable[[list[int]], "int | None"]
Observer = Callable[[list[int], torch.Tensor], None]


class Timer:
    """The draft / verify split of one generation. CPU: the wall clock at each phase end. CUDA: an event recorded at
    each phase end, so the loop never waits for the device; `settle` (at the end of the generation, after its one
    final synchronization) adds the times between the events to the stats."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.t = time.perf_counter()
        self.marks: list[tuple[str, object, object]] = []  # CUDA: (stats field, start event, end event)
        self.last = self._event() if self.cuda else None

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, stats: DecodeStats, key: str) -> None:
        """The phase that ends now goes to stats.<key> (draft_s, verify_s)."""
        if self.cuda:
            end = self._event()
            self.marks.append((key, self.last, end))
            self.last = end
            return
        now = time.perf_counter()
        setattr(stats, key, getattr(stats, key) + now - self.t)
        self.t = now

    def settle(self, stats: DecodeStats) -> None:
        """CUDA: wait for the last event once and add every phase's time to the stats."""
        if self.marks:
            self.marks[-1][2].synchronize()
            for key, a, b in self.marks:
                setattr(stats, key, getattr(stats, key) + a.elapsed_time(b) / 1000)
            self.marks = []


@dataclass
class DecodeState:
    """Everything one generation holds between rounds."""

    cfg: DecodeConfig
    tokens: torch.Tensor  # (max_len,) ids: [0, n) committed, [n, n+k) this round's drafts
    prompt_len: int
    n: int  # committed tokens; the last one has not been through the full stack yet
    cache: KVCache  # the target's, all L layers, written by position
    drafter: object  # drafters.Drafter: the head's way of drafting (NoDrafter without a head)
    draft_len: int  # the deepest draft a round proposes (0: autoregressive)
    eos: torch.Tensor  # (E,) ids that end the generation
    generator: torch.Generator | None  # sampling only
    stats: DecodeStats
    verified: int = 0  # positions [0, verified) hold the full stack's K/V in every layer of `cache`
    done: bool = False
    timer: Timer | None = None
    eos_ids: frozenset = frozenset()  # `eos` on the host: a round's EOS check needs no device round trip
    proposer: object = None  # proposers.Proposer: the strategy that proposes each round's drafts
    out: list[int] = field(default_factory=list)  # the new tokens [prompt_len, n) on the host

    @property
    def new_tokens(self) -> int:
        return self.n - self.prompt_len

    @property
    def room(self) -> int:
        """Drafts this round may still propose: a round commits its drafts and the target's own token."""
        return self.cfg.max_new_tokens - self.new_tokens - 1


@dataclass
class DecodeResult:
    token_ids: list[int]  # new tokens (a final EOS included, as HF does)
    stats: DecodeStats
