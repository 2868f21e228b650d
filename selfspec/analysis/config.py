"""The analysis's own typed config (conf/analyze.yaml minus the model / data / logger groups)."""

from __future__ import annotations

from dataclasses import dataclass, field

from selfspec.errors import check, is_number


def _ints(values, key: str, lo: int = 1) -> list[int]:
    values = list(values)
    check(bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in values),
          f"{key}={values}: a non-empty list of integers >= {lo}")
    return sorted(set(values))


@dataclass
class TimingConfig:
    context: int | None = None  # context length the steps are timed at; None = mean prompt + half an answer
    repeats: int = 10           # median over this many paired (step, autoregressive step) timings
    warmup: int = 3

    def __post_init__(self):
        check(self.context is None or (isinstance(self.context, int) and self.context >= 1),
              f"timing.context={self.context!r}: an integer >= 1, or null (mean prompt + half an answer)")
        check(isinstance(self.repeats, int) and self.repeats >= 1, f"timing.repeats={self.repeats!r}: an integer >= 1")
        check(isinstance(self.warmup, int) and self.warmup >= 0, f"timing.warmup={self.warmup!r}: an integer >= 0")


@dataclass
class AnalysisConfig:
    heads: list[str] = field(default_factory=lambda: ["lens"])
    max_new_tokens: int = 128
    chat: bool | None = None             # None: the tokenizer's chat template when it has one (as eval)
    topk: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    draft_lens: list[int] = field(default_factory=lambda: list(range(1, 9)))
    draft_threshold: float | None = None  # also replay the engine's dynamic K at this threshold
    draft_continue: float | None = None  # also replay joint-confidence K (decode.draft_continue) at each K of draft_lens
    costs: bool = True
    timing: TimingConfig = field(default_factory=TimingConfig)
    answers_dir: str | None = None       # the answers cache; None = $SELFSPEC_CACHE/analysis
    chunk: int = 128                     # positions per LM-head call (memory: chunk x vocab floats)
    # also replay decode.lookup_mode=first with these lookup settings (metrics.replay_lookup_first)
    lookup_first: bool = False
    lookup_len: int = 3
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 3

    @property
    def lookup(self) -> dict:
        return {"len": self.lookup_len, "min_ngram": self.lookup_min_ngram, "max_ngram": self.lookup_max_ngram}

    def __post_init__(self):
        if isinstance(self.heads, str):
            self.heads = [self.heads]
        self.heads = [str(h) for h in self.heads]
        check(len(self.heads) > 0, "heads: give at least one head, e.g. heads=[lens@4,medusa@6,DIR]")
        check(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 2,
              f"max_new_tokens={self.max_new_tokens!r}: an integer >= 2")
        self.topk = _ints(self.topk, "topk")
        self.draft_lens = _ints(self.draft_lens, "draft_lens")
        check(self.draft_lens[-1] <= 16, f"draft_lens={self.draft_lens}: at most 16")
        check(self.draft_threshold is None or 0.0 <= self.draft_threshold < 1.0,
              f"draft_threshold={self.draft_threshold!r}: in [0, 1) or null")
        check(self.draft_continue is None or is_number(self.draft_continue) and 0.0 < self.draft_continue < 1.0,
              f"draft_continue={self.draft_continue!r}: in (0, 1) or null")
        check(isinstance(self.costs, bool), f"costs={self.costs!r}: true or false")
        check(self.chat is None or isinstance(self.chat, bool), f"chat={self.chat!r}: true, false or null (the tokenizer's choice)")
        check(isinstance(self.chunk, int) and self.chunk >= 1, f"chunk={self.chunk!r}: an integer >= 1")
        check(isinstance(self.lookup_first, bool), f"lookup_first={self.lookup_first!r}: true or false")
        check(isinstance(self.lookup_len, int) and 1 <= self.lookup_len <= self.draft_lens[-1],
              f"lookup_len={self.lookup_len!r}: an integer in [1, {self.draft_lens[-1]}] (the largest of draft_lens: "
              "its verify cost is timed)")
        check(isinstance(self.lookup_min_ngram, int) and self.lookup_min_ngram >= 1,
              f"lookup_min_ngram={self.lookup_min_ngram!r}: an integer >= 1")
        check(isinstance(self.lookup_max_ngram, int) and self.lookup_max_ngram >= self.lookup_min_ngram,
              f"lookup_max_ngram={self.lookup_max_ngram!r}: an integer >= lookup_min_ngram ({self.lookup_min_ngram})")
        if not isinstance(self.timing, TimingConfig):
            # omegaconf is loaded by the command line; the analysis library imports without it
            from selfspec.utils.config import build

            self.timing = build(TimingConfig, self.timing, "timing")
