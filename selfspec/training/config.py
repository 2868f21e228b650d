"""Typed configs for `python -m selfspec.train`: what data to distil on, and how to train.

Both validate themselves in `__post_init__` (peft style): a bad value fails with one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from selfspec.errors import SelfSpecError, check

DATA_SOURCES = ("selfgen", "jsonl", "mix", "sharegpt")
FEATURE_DTYPES = ("float16", "bfloat16", "float32")
SYNTH_DTYPES = ("float32", "bfloat16")
PRECISIONS = ("fp32", "bf16")
_NOT_ALSO = ("also", "feature_dtype")  # one feature dtype for the whole union


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
    mix: dict | None = None  # data=mix: sources, weights and limits (selfspec/training/mix/build.py: MixConfig)
    sharegpt: dict | None = None  # data=sharegpt: budget, context, supervision (training/sharegpt.py: ShareGPTConfig)
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
            from selfspec.training.mix.build import mix_config

            self.mix = mix_config(self.mix)
        if self.source == "sharegpt":
            from selfspec.training.sharegpt import sharegpt_config

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
            from selfspec.decoding.config import DecodeConfig

            self.decode = DecodeConfig()
        if self.logger is None:
            from selfspec.utils.logger import LoggerConfig

            self.logger = LoggerConfig(kind="none")
