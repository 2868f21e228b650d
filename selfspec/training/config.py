"""Typed configs for `python -m selfspec.train`: what data to distil on (with data=mix's and data=sharegpt's own
groups, MixConfig and ShareGPTConfig), and how to train.

All validate themselves in `__post_init__` (peft style): a bad value fails with one line naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from selfspec.data.exclude import EVALUATED, SHIPPED, resolve_entries
from selfspec.decoding.config import DecodeConfig
from selfspec.errors import SelfSpecError, check, is_int, is_number
from selfspec.training.mix.catalogs import LANGUAGES
from selfspec.utils.logger import LoggerConfig

DATA_SOURCES = ("selfgen", "jsonl", "mix", "sharegpt")
FEATURE_DTYPES = ("float16", "bfloat16", "float32")
SYNTH_DTYPES = ("float32", "bfloat16")
PRECISIONS = ("fp32", "bf16")
_NOT_ALSO = ("also", "feature_dtype")  # one feature dtype for the whole union
MIX_SOURCES = ("magpie", "files", "documents", "package_docs", "code", "translation", "multiturn")
# data.mix.exclude's default: Spec-Bench's prompts (hashes shipped in the package) and every evaluated prompt file
MIX_DEFAULT_EXCLUDE = ("spec_bench", "evaluated")
SUPERVISE = ("all", "last_answer")  # data.sharegpt.supervise


def _build(cls, node, key: str):
    """`node` (a mapping or a Hydra node) as a validated `cls` (utils/config.py: build)."""
    # omegaconf is loaded by the command lines; the training library imports without it
    from selfspec.utils.config import build

    return build(cls, node, key)


def _int_at_least(value, minimum: int, key: str) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    check(ok, f"{key}={value!r}: must be an integer >= {minimum}")


@dataclass
class DataConfig:
    """Where the training sequences come from. Everything the target generates is cached on disk, keyed by
    the model's fingerprint and these settings, so reruns and sweeps pay for synthesis once."""

    source: str = "selfgen"  # selfgen: Magpie-style self-generated prompts | jsonl: a prompt file | mix: see data.mix
    # | sharegpt: real conversations, teacher-forced (training/sharegpt.py)
    path: str | None = None  # jsonl: the prompt file (Spec-Bench `turns`, ShareGPT `conversations`, `prompt`/`text`)
    format: str = "auto"  # jsonl: auto | spec_bench | sharegpt | prompt
    limit: int | None = None  # jsonl: keep at most this many prompts (validation ones included)
    use_given: bool = False  # jsonl: train on the file's reference/assistant text instead of the target's answers
    num_prompts: int = 256  # selfgen: training prompts to synthesize
    val_prompts: int = 8  # prompts held out for validation decoding
    prompt_max_tokens: int = 64  # selfgen: max length of a sampled user message
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    # selfgen: system messages that steer what kind of user message the target writes (Magpie with a system
    # prompt). Rows of each sampling batch cycle through [no system message] + these. Answers never see them.
    system_prompts: list[str] = field(default_factory=list)
    answer_max_tokens: int = 160
    answer_temperature: float = 0.0  # 0 = greedy answers (what greedy decoding will see)
    answer_top_p: float = 1.0
    batch_size: int = 32  # generation batch: batching is what makes synthesis fast on CPU
    topk: int = 32  # soft targets kept per position (the full model's top-k distribution)
    feature_dtype: str = "float16"  # cached layer-E hidden states
    seed: int = 0
    # float32: the target itself writes prompts and answers | bfloat16: a bfloat16 copy of it, several times
    # faster on CPUs with AMX / AVX512-BF16 (training/synthesis.py: synthesis_backbone says what it costs)
    synth_dtype: str = "float32"
    token_budget: int = 24576  # generation: rows x KV-cache length held at once (synthesis.BatchSettings)
    mix: dict | None = None  # data=mix: sources, weights and limits (MixConfig below; built by selfspec/training/mix/build.py)
    sharegpt: dict | None = None  # data=sharegpt: budget, context, supervision (ShareGPTConfig below; built by training/sharegpt.py)
    # More datasets to train on together with this one, each named by the keys it changes, e.g. [{seed: 7,
    # num_prompts: 1200}] (an earlier data=mix stage). Each is read from its cache (built when missing); validation
    # prompts are this dataset's alone, and the others' sequences whose prompt is one of them are left out.
    also: list = field(default_factory=list)

    def __post_init__(self):
        check(self.source in DATA_SOURCES, f"data.source={self.source!r}: allowed {', '.join(DATA_SOURCES)}")
        if self.source == "jsonl":
            check(bool(self.path), "data.path: required with data=jsonl (a .jsonl or .json prompt file)")
        check(self.limit is None or (isinstance(self.limit, int) and self.limit >= 1), f"data.limit={self.limit!r}: must be an integer >= 1 or null")
        _int_at_least(self.num_prompts, 1, "data.num_prompts")
        _int_at_least(self.val_prompts, 1, "data.val_prompts")
        _int_at_least(self.prompt_max_tokens, 1, "data.prompt_max_tokens")
        _int_at_least(self.answer_max_tokens, 1, "data.answer_max_tokens")
        _int_at_least(self.batch_size, 1, "data.batch_size")
        _int_at_least(self.topk, 1, "data.topk")
        for key in ("prompt_temperature", "answer_temperature"):
            check(getattr(self, key) >= 0, f"data.{key}={getattr(self, key)}: must be >= 0 (0 = greedy)")
        for key in ("prompt_top_p", "answer_top_p"):
            check(0 < getattr(self, key) <= 1, f"data.{key}={getattr(self, key)}: must be in (0, 1]")
        check(isinstance(self.system_prompts, (list, tuple)) and all(isinstance(x, str) and x.strip() for x in self.system_prompts),
              "data.system_prompts: must be a list of non-empty strings")
        self.system_prompts = list(self.system_prompts)
        check(self.feature_dtype in FEATURE_DTYPES, f"data.feature_dtype={self.feature_dtype!r}: allowed {', '.join(FEATURE_DTYPES)}")
        check(self.synth_dtype in SYNTH_DTYPES, f"data.synth_dtype={self.synth_dtype!r}: allowed {', '.join(SYNTH_DTYPES)}")
        _int_at_least(self.token_budget, 1, "data.token_budget")
        if self.source == "mix":
            self.mix = mix_config(self.mix)
        if self.source == "sharegpt":
            self.sharegpt = sharegpt_config(self.sharegpt)
        check(isinstance(self.also, (list, tuple)) and all(isinstance(x, dict) for x in self.also),
              f"data.also={self.also!r}: must be a list of mappings of data keys, e.g. [{{seed: 7}}]")
        self.also = [dict(x) for x in self.also]
        self.extra_datasets()  # each one validated now

    def extra_datasets(self) -> list["DataConfig"]:
        """data.also as DataConfigs: this one with each entry's keys changed (another source starts from that
        source's defaults for data.mix / data.sharegpt)."""
        allowed = sorted(f.name for f in fields(self) if f.name not in _NOT_ALSO)
        out = []
        for i, entry in enumerate(self.also):
            bad = sorted(set(entry) - set(allowed))
            check(not bad, f"data.also[{i}]: unknown key(s) {', '.join(bad)}; allowed: {', '.join(allowed)}")
            base = {} if entry.get("source", self.source) == self.source else {"mix": None, "sharegpt": None}
            try:
                out.append(replace(self, also=[], **{**base, **entry}))
            except SelfSpecError as exc:
                raise SelfSpecError(f"data.also[{i}]: {exc}") from None
        return out


@dataclass
class MixConfig:
    """`data.mix`: what `data=mix` draws from (training/mix/build.py, whose docstring says what each key does)."""

    weights: dict = field(default_factory=lambda: {"magpie": 0.2, "files": 0.0, "documents": 0.25, "package_docs": 0.1,
                                                   "code": 0.15, "translation": 0.15, "multiturn": 0.15})
    files: list = field(default_factory=list)  # prompt files for the `files` share
    requests_per_document: int = 2  # requests asked about each document the target writes
    document_max_tokens: int = 384  # a document's length at most
    document_temperature: float = 0.7  # documents are sampled (greedy ones from a 135M model loop)
    document_top_p: float = 0.95
    train_on_documents: bool = True  # the (writing request, document) pairs are training data too
    context_max_tokens: int = 1024  # a prompt's chat-encoded length at most; longer ones are dropped
    languages: list = field(default_factory=lambda: ["de", "fr", "es"])  # catalogue languages
    exclude: list = field(default_factory=lambda: list(MIX_DEFAULT_EXCLUDE))  # spec_bench | evaluated | a prompt file
    exclude_builtin: bool = True  # also the builtin evaluation prompts (selfspec/data/builtin_prompts.jsonl)
    exclude_ngram: int = 8
    exclude_overlap: float = 0.2  # drop a prompt when this share of its word n-grams is in an excluded prompt
    shard_prompts: int = 64  # finished answers per shard file

    def __post_init__(self):
        check(isinstance(self.weights, dict) and self.weights, "data.mix.weights: must be a mapping source -> weight")
        unknown = sorted(set(self.weights) - set(MIX_SOURCES))
        check(not unknown, f"data.mix.weights: unknown source(s) {', '.join(unknown)}; allowed {', '.join(MIX_SOURCES)}")
        for k, v in self.weights.items():
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and math.isfinite(v),
                  f"data.mix.weights.{k}={v!r}: must be a number >= 0")
        self.weights = {k: float(self.weights.get(k, 0.0)) for k in MIX_SOURCES}
        check(sum(self.weights.values()) > 0, "data.mix.weights: at least one weight must be > 0")
        check(isinstance(self.files, (list, tuple)) and all(isinstance(f, str) and f for f in self.files),
              "data.mix.files: must be a list of prompt file paths")
        self.files = list(self.files)
        check(not (self.weights["files"] > 0 and not self.files), "data.mix.weights.files > 0 needs data.mix.files (prompt files)")
        for key in ("requests_per_document", "document_max_tokens", "context_max_tokens", "exclude_ngram", "shard_prompts"):
            v = getattr(self, key)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"data.mix.{key}={v!r}: must be an integer >= 1")
        check(isinstance(self.document_temperature, (int, float)) and self.document_temperature >= 0,
              f"data.mix.document_temperature={self.document_temperature!r}: must be >= 0 (0 = greedy)")
        check(isinstance(self.document_top_p, (int, float)) and 0 < self.document_top_p <= 1,
              f"data.mix.document_top_p={self.document_top_p!r}: must be in (0, 1]")
        check(isinstance(self.exclude_overlap, (int, float)) and 0 < self.exclude_overlap <= 1,
              f"data.mix.exclude_overlap={self.exclude_overlap!r}: must be in (0, 1]")
        check(isinstance(self.languages, (list, tuple)) and self.languages and all(l in LANGUAGES for l in self.languages),
              f"data.mix.languages={self.languages!r}: a non-empty list of {', '.join(LANGUAGES)}")
        self.languages = list(self.languages)
        check(isinstance(self.exclude, (list, tuple)) and all(isinstance(f, str) and f for f in self.exclude),
              f"data.mix.exclude: must be a list of {', '.join(SHIPPED)}, {EVALUATED} or prompt file paths")
        named = (*SHIPPED, EVALUATED)
        exclude = []
        for entry in self.exclude:
            if entry not in named:  # a file: resolved now (never relative to a later cwd), and it must be there
                path = Path(entry).expanduser().resolve()
                check(path.is_file(), f"data.mix.exclude: {entry!r} is not a file ({path}); give a prompt file or one of "
                                      f"{', '.join(named)} (Spec-Bench's prompts ship as hashes: spec_bench)")
                entry = str(path)
            exclude.append(entry)
        self.exclude = exclude
        for key in ("train_on_documents", "exclude_builtin"):
            check(isinstance(getattr(self, key), bool), f"data.mix.{key}={getattr(self, key)!r}: allowed true or false")


def mix_config(node) -> MixConfig:
    """data.mix (a mapping, or None for the defaults) as a validated MixConfig."""
    if isinstance(node, MixConfig):
        return node
    return _build(MixConfig, node or {}, "data.mix")

@dataclass
class ShareGPTConfig:
    """`data.sharegpt` (training/sharegpt.py); data.topk, data.seed, data.val_prompts and data.feature_dtype are the data group's own."""

    max_tokens: int = 100_000  # the training-token budget: supervised positions (nested: 0.1M is a prefix of 2M)
    context_max_tokens: int = 2048  # a chunk's chat-encoded length at most
    supervise: str = "all"  # all: every position of the text | last_answer: the chunk's last assistant turn
    feature_layers: list = field(default_factory=list)  # hidden states kept in the same pass (E = L: the last layer's)
    path: str | None = None  # a ShareGPT JSON file instead of the package's
    exclude: list = field(default_factory=lambda: ["spec_bench", "evaluated"])  # as data.mix.exclude
    exclude_builtin: bool = True  # the builtin evaluation prompts too
    exclude_ngram: int = 8
    exclude_overlap: float = 0.2  # a user turn with this share of its word n-grams in an excluded prompt
    shard_sequences: int = 64  # chunks per shard file: an interruption loses at most this many
    batch_tokens: int = 4096  # padded tokens per forward pass

    def __post_init__(self):
        for key, low in (("max_tokens", 1), ("context_max_tokens", 16), ("exclude_ngram", 1), ("shard_sequences", 1),
                         ("batch_tokens", 1)):
            v = getattr(self, key)
            check(is_int(v) and v >= low, f"data.sharegpt.{key}={v!r}: must be an integer >= {low}")
        check(self.supervise in SUPERVISE, f"data.sharegpt.supervise={self.supervise!r}: allowed {', '.join(SUPERVISE)}")
        check(isinstance(self.feature_layers, (list, tuple)) and all(is_int(e) and e >= 1 for e in self.feature_layers),
              f"data.sharegpt.feature_layers={self.feature_layers!r}: a list of layer numbers >= 1")
        self.feature_layers = sorted(set(self.feature_layers))
        check(self.path is None or isinstance(self.path, str) and self.path.strip(), f"data.sharegpt.path={self.path!r}: a file or null")
        if self.path is not None:  # resolved now: no later working directory decides which file it is
            p = Path(self.path).expanduser().resolve()
            check(p.is_file(), f"data.sharegpt.path: {self.path!r} is not a file ({p})")
            self.path = str(p)
        self.exclude = resolve_entries(self.exclude, "data.sharegpt.exclude")
        check(isinstance(self.exclude_builtin, bool), f"data.sharegpt.exclude_builtin={self.exclude_builtin!r}: allowed true or false")
        check(is_number(self.exclude_overlap) and 0 < self.exclude_overlap <= 1,
              f"data.sharegpt.exclude_overlap={self.exclude_overlap!r}: must be in (0, 1]")


def sharegpt_config(node) -> ShareGPTConfig:
    """data.sharegpt (a mapping, or None for the defaults) as a validated ShareGPTConfig."""
    if isinstance(node, ShareGPTConfig):
        return node
    return _build(ShareGPTConfig, node or {}, "data.sharegpt")


@dataclass
class TrainerConfig:
    max_steps: int = 200  # optimizer steps
    batch_size: int = 8  # sequences per micro-batch (all their response positions train at once)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max grad norm; 0 = off
    distill_temperature: float = 1.0  # softens both distributions in the soft loss (scaled by T^2)
    hard_weight: float = 0.0  # weight of the hard-label cross-entropy on the target's own next token
    extra_head_decay: float = 0.8  # medusa: head i (predicting t+1+i) weighs decay^i
    precision: str = "fp32"  # bf16 = autocast on CUDA (ignored on CPU)
    seed: int = 0
    log_every: int = 10
    val_every: int = 0  # validation decoding every N steps (0 = only at the end)
    ckpt_every: int = 100  # checkpoint every N steps (0 = never)
    keep_checkpoints: int = 2
    # auto: continue from the checkpoint dir's last checkpoint when it has one (a requeued or relaunched SLURM job), else
    # start at step 0; true: the same, with a warning when there is none; false: start at step 0; or a checkpoint
    # file / run dir
    resume: bool | str = "auto"
    resume_override: bool = False  # resume even when the checkpoint was trained with other settings (lr, data, ...)
    stop_after: int | None = None  # stop (like a preempted job: checkpoint, no final head) after this step
    # where checkpoints go (null: <run dir>/checkpoints; in a SLURM job with resume=auto|true a directory named by the
    # job's config, so that a requeue or relaunch finds it: training/run.py checkpoint_dir)
    checkpoint_dir: str | None = None
    compare_lens: bool = False  # after training, also decode with the untrained logit lens and print a table
    num_threads: int | None = None  # torch CPU threads (null = torch's default)
    train_tokens: int | None = None  # train on a seeded subset of whole sequences with >= this many answer tokens (null = all)
    # A fresh head of head.* starting from a saved head's weights (a directory or a shipped head's name) where names
    # and shapes match, the rest at their initialisation; its draft vocabulary too. E.g. a fused context head
    # (head.context_source=fused) from a final-source one: the fusion starts at the final state, so it starts as
    # that head. head.path instead continues a saved head as it is.
    init_from: str | None = None

    def __post_init__(self):
        _int_at_least(self.max_steps, 1, "trainer.max_steps")
        _int_at_least(self.batch_size, 1, "trainer.batch_size")
        _int_at_least(self.grad_accum, 1, "trainer.grad_accum")
        check(self.lr > 0, f"trainer.lr={self.lr}: must be > 0")
        check(0 <= self.min_lr_ratio <= 1, f"trainer.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        _int_at_least(self.warmup_steps, 0, "trainer.warmup_steps")
        check(self.weight_decay >= 0, f"trainer.weight_decay={self.weight_decay}: must be >= 0")
        check(self.grad_clip >= 0, f"trainer.grad_clip={self.grad_clip}: must be >= 0 (0 = off)")
        check(self.distill_temperature > 0, f"trainer.distill_temperature={self.distill_temperature}: must be > 0")
        check(self.hard_weight >= 0, f"trainer.hard_weight={self.hard_weight}: must be >= 0")
        check(0 < self.extra_head_decay <= 1, f"trainer.extra_head_decay={self.extra_head_decay}: must be in (0, 1]")
        check(self.precision in PRECISIONS, f"trainer.precision={self.precision!r}: allowed {', '.join(PRECISIONS)}")
        _int_at_least(self.log_every, 1, "trainer.log_every")
        _int_at_least(self.val_every, 0, "trainer.val_every")
        _int_at_least(self.ckpt_every, 0, "trainer.ckpt_every")
        _int_at_least(self.keep_checkpoints, 1, "trainer.keep_checkpoints")
        check(isinstance(self.resume, (bool, str)), f"trainer.resume={self.resume!r}: auto, true, false or a checkpoint path")
        check(self.checkpoint_dir is None or isinstance(self.checkpoint_dir, str) and self.checkpoint_dir.strip(),
              f"trainer.checkpoint_dir={self.checkpoint_dir!r}: a directory or null")
        check(isinstance(self.resume_override, bool), f"trainer.resume_override={self.resume_override!r}: allowed true or false")
        if self.stop_after is not None:
            _int_at_least(self.stop_after, 1, "trainer.stop_after")
        if self.train_tokens is not None:
            _int_at_least(self.train_tokens, 1, "trainer.train_tokens")
        if self.num_threads is not None:
            _int_at_least(self.num_threads, 1, "trainer.num_threads")
        check(self.init_from is None or isinstance(self.init_from, str) and self.init_from.strip() != "",
              f"trainer.init_from={self.init_from!r}: a saved head's directory or a shipped head's name, or null")


@dataclass
class TrainRunConfig:
    """One training run, typed: what `python -m selfspec.train` builds from conf/train.yaml
    (selfspec/cli/train.py: build_configs), and what another tool passes to `selfspec.training.train_head`
    (the evaluation's head cache: the evaluated model and head, its own trainer and data settings)."""

    model: Any  # selfspec.model.loading.ModelConfig
    head: Any  # the head's config (selfspec.heads)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    decode: Any = None  # validation decoding (selfspec.decoding's DecodeConfig); None = its defaults
    logger: Any = None  # selfspec.utils.logger.LoggerConfig; None = no logging

    def __post_init__(self):
        if self.decode is None:
            self.decode = DecodeConfig()
        if self.logger is None:
            self.logger = LoggerConfig(kind="none")
