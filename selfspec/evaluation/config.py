"""Typed configs of `python -m selfspec.eval` (conf/eval.yaml): its prompt set (conf/prompts/), the methods,
the HF baselines' options, the calibration of E, K and decode.tree=auto (`auto`) and the head cache. Each
validates itself in `__post_init__`; a bad value fails with one line naming the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from selfspec.decoding.config import MAX_DRAFT_LEN, MAX_TREE_NODES
from selfspec.errors import SelfSpecError, check
from selfspec.training.config import DataConfig, TrainerConfig

PROMPT_FORMATS = ("auto", "spec_bench", "sharegpt", "prompt")


def _is_int(x: Any, minimum: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _ints(values: Any, key: str, minimum: int = 1) -> list[int]:
    ok = isinstance(values, (list, tuple)) and len(values) > 0 and all(_is_int(v, minimum) for v in values)
    check(ok, f"{key}={values!r}: must be a non-empty list of integers >= {minimum}")
    return [int(v) for v in values]


def _bool(value: Any, key: str) -> bool:
    check(isinstance(value, bool), f"{key}={value!r}: allowed true or false")
    return value


def _build(cls, node, key: str):
    """`node` (a mapping or a Hydra node) as a validated `cls` (utils/config.py: build)."""
    # omegaconf is loaded by the command lines; evaluation's configs (and evaluation/runner.py) import without it
    from selfspec.utils.config import build

    return build(cls, node, key)


@dataclass
class PromptSetConfig:
    """Which prompts an evaluation runs (conf/prompts/: builtin | spec_bench | jsonl)."""

    path: str | None = None  # a prompt file; None = the prompts shipped with selfspec
    format: str = "auto"  # auto | spec_bench | sharegpt | prompt (see selfspec/data/prompts.py)
    limit: int | None = None  # at most this many prompts (per category when per_category)
    categories: list[str] | None = None  # keep only these categories (task names for Spec-Bench)
    per_category: bool = False  # limit counts per category instead of in total
    spec_bench_tasks: bool = False  # MT-bench's eight categories count as one Spec-Bench task, mt_bench

    def __post_init__(self):
        check(self.path is None or (isinstance(self.path, str) and self.path.strip() != ""),
              f"prompts.path={self.path!r}: a prompt file, or null for the built-in prompts")
        check(self.format in PROMPT_FORMATS, f"prompts.format={self.format!r}: must be one of {', '.join(PROMPT_FORMATS)}")
        check(self.limit is None or _is_int(self.limit, 1),
              f"prompts.limit={self.limit!r}: must be an integer >= 1, or null for all prompts")
        if isinstance(self.categories, str):
            self.categories = [self.categories]
        if self.categories is not None:
            check(isinstance(self.categories, (list, tuple)) and all(isinstance(c, str) for c in self.categories),
                  f"prompts.categories={self.categories!r}: must be a list of category names")
            self.categories = list(self.categories) or None  # [] = no filter, as null
        _bool(self.per_category, "prompts.per_category")
        _bool(self.spec_bench_tasks, "prompts.spec_bench_tasks")


@dataclass
class HFOptions:
    """The HF baselines' settings (`hf.*`)."""

    num_assistant_tokens: int | None = None  # hf_early_exit drafts per round; None = HF's default schedule
    prompt_lookup_num_tokens: int = 10  # hf_prompt_lookup drafts per round (Spec-Bench's PLD setting)
    max_matching_ngram_size: int | None = None  # None = HF's default (2)

    def __post_init__(self):
        for key in ("num_assistant_tokens", "max_matching_ngram_size"):
            v = getattr(self, key)
            check(v is None or _is_int(v, 1), f"hf.{key}={v!r}: must be an integer >= 1, or null for HF's default")
        check(_is_int(self.prompt_lookup_num_tokens, 1),
              f"hf.prompt_lookup_num_tokens={self.prompt_lookup_num_tokens!r}: must be an integer >= 1")


@dataclass
class AutoConfig:
    """Calibration before the run (evaluation/calibration.py), by predicted speedup on this hardware:
    `auto.enabled=true` chooses K (and E among cached heads); `decode.tree=auto` chooses the chain or a draft tree
    (a dynamic tree of each of `tree_nodes` nodes, and with `tree_static` the static decode.tree_shape)."""

    enabled: bool = False
    draft_lens: list[int] = field(default_factory=lambda: list(range(1, 9)))  # candidate K
    exit_layers: list[int] | None = None  # candidate E; None = the configured head plus every cached one
    tree_nodes: list[int] = field(default_factory=lambda: [4, 8, 16])  # decode.tree=auto: candidate dynamic tree sizes
    tree_static: bool = False  # decode.tree=auto: the static decode.tree_shape is a candidate too
    prompts: int = 2  # calibration prompts: the first turns of the first N prompts
    max_new_tokens: int = 32
    repeats: int = 5  # step timings: the median of this many paired ratios

    def __post_init__(self):
        _bool(self.enabled, "auto.enabled")
        self.draft_lens = sorted(set(_ints(self.draft_lens, "auto.draft_lens")))
        check(self.draft_lens[-1] <= MAX_DRAFT_LEN, f"auto.draft_lens={self.draft_lens}: at most {MAX_DRAFT_LEN}")
        if self.exit_layers is not None:
            self.exit_layers = _ints(self.exit_layers, "auto.exit_layers")
        self.tree_nodes = sorted(set(_ints(self.tree_nodes, "auto.tree_nodes")))
        check(self.tree_nodes[-1] <= MAX_TREE_NODES, f"auto.tree_nodes={self.tree_nodes}: at most {MAX_TREE_NODES} nodes")
        _bool(self.tree_static, "auto.tree_static")
        check(_is_int(self.prompts, 1), f"auto.prompts={self.prompts!r}: must be an integer >= 1")
        check(_is_int(self.max_new_tokens, 1), f"auto.max_new_tokens={self.max_new_tokens!r}: must be an integer >= 1")
        check(_is_int(self.repeats, 1), f"auto.repeats={self.repeats!r}: must be an integer >= 1")


@dataclass
class HeadCacheConfig:
    """Heads per exit layer for sweeps (evaluation/head_cache.py), and how a missing one is trained: through
    `selfspec.training.train_head` with the recipe `trainer` + `data` (training's own typed configs; their
    defaults are conf/trainer/default.yaml and conf/data/selfgen.yaml)."""

    dir: str | None = None  # None = $SELFSPEC_CACHE/heads
    train_missing: bool = True  # train a missing trained-type head once; else use it untrained
    trainer: Any = None  # selfspec.training.TrainerConfig, or its fields
    data: Any = None  # selfspec.training.DataConfig, or its fields

    def __post_init__(self):
        _bool(self.train_missing, "head_cache.train_missing")
        try:  # training's messages name `trainer.*` / `data.*`: here they are head_cache.trainer.* / .data.*
            if not isinstance(self.trainer, TrainerConfig):
                self.trainer = _build(TrainerConfig, self.trainer or {}, "trainer")
            if not isinstance(self.data, DataConfig):
                self.data = _build(DataConfig, self.data or {}, "data")
        except SelfSpecError as exc:
            raise SelfSpecError(f"head_cache.{exc}") from None


@dataclass
class EvalConfig:
    """The keys of conf/eval.yaml that are evaluation's own (the model / head / decode / prompts / logger
    groups have their own types)."""

    methods: list[str] = field(default_factory=lambda: ["hf_generate", "hf_early_exit", "hf_prompt_lookup",
                                                        "autoregressive", "selfspec"])
    reference: str | None = None  # speedup and lossless are against this method; None: hf_generate if run
    chat: bool | None = None  # None: the tokenizer's chat template when it has one
    warmup: bool = True
    save_prompts: bool = False
    threads: Any = "auto"  # "auto": adapt to the machine's load before each prompt (utils/machine.py); or a count
    hf: HFOptions = field(default_factory=HFOptions)
    auto: AutoConfig = field(default_factory=AutoConfig)
    head_cache: HeadCacheConfig = field(default_factory=HeadCacheConfig)

    def __post_init__(self):
        if isinstance(self.methods, str):
            self.methods = [self.methods]
        self.methods = list(self.methods)
        check(self.chat is None or isinstance(self.chat, bool), f"chat={self.chat!r}: true, false or null")
        _bool(self.warmup, "warmup")
        _bool(self.save_prompts, "save_prompts")
        check(self.threads == "auto" or (isinstance(self.threads, int) and not isinstance(self.threads, bool)
                                         and self.threads >= 1),
              f"threads={self.threads!r}: must be auto or an integer >= 1")
        check(self.reference is None or self.reference in self.methods,
              f"reference={self.reference!r}: not among methods={self.methods}")
        for key, cls in (("hf", HFOptions), ("auto", AutoConfig), ("head_cache", HeadCacheConfig)):
            if not isinstance(getattr(self, key), cls):
                setattr(self, key, _build(cls, getattr(self, key) or {}, key))

    @property
    def reference_method(self) -> str:
        return self.reference or ("hf_generate" if "hf_generate" in self.methods else "autoregressive")
