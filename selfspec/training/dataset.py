"""Training sequences and the full model's soft targets, built once and cached on disk.

A dataset is keyed by the model's fingerprint and the data settings, under
`<cache_dir>/data/<model key>/<data key>/`, so reruns and sweep jobs reuse it:

  prompts.json            selfgen: the sampled prompts (written first: a killed run does not resample them)
  dataset.pt              token ids of every (chat prompt + response), top-k targets at response positions,
                          the held-out validation prompts
  hidden-E<E>-<dtype>.pt  layer-E hidden states of every position (features.py)
  config.json             the settings that made it (for people)

Building is guarded by a file lock, so parallel sweep jobs wait for one builder instead of racing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError, check
from selfspec.training.config import DataConfig

DATASET_FILE = "dataset.pt"
PROMPTS_FILE = "prompts.json"  # the sampled prompts alone, kept while the answers are being generated
FORMAT = "selfspec-distill/1"


@dataclass
class Sequences:
    """n sequences (chat-encoded prompt + response) and soft targets at their R response positions.

    tokens        (S,)   every sequence's ids, concatenated; sequence b is tokens[seq_offsets[b]:seq_offsets[b+1]]
    seq_offsets   (n+1,)
    prompt_lens   (n,)   P_b; the response is the rest of the sequence
    topk_ids      (R, k) the full model's top-k ids at response positions (row j of sequence b is the
                         distribution from position P_b-1+j, which predicts response token j)
    topk_logprobs (R, k) their log-probabilities
    resp_offsets  (n+1,) sequence b's target rows are resp_offsets[b]:resp_offsets[b+1]
    """

    tokens: torch.Tensor
    seq_offsets: torch.Tensor
    prompt_lens: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    resp_offsets: torch.Tensor
    val_prompts: list[str]
    train_prompts: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: list[tuple[list[int], list[int]]], targets: list[tuple[torch.Tensor, torch.Tensor]],
                   val_prompts: list[str], train_prompts: list[str], meta: dict) -> "Sequences":
        """pairs: (prompt ids, response ids); targets: (top-k ids (n, k), logprobs (n, k)) per response."""
        keep = [i for i, (_, r) in enumerate(pairs) if len(r) > 0]
        check(len(keep) > 0, "data: no usable training sequences (every response is empty)")
        pairs = [pairs[i] for i in keep]
        targets = [targets[i] for i in keep]
        lengths = torch.tensor([len(p) + len(r) for p, r in pairs])
        resp_lengths = torch.tensor([len(r) for _, r in pairs])
        return cls(
            tokens=torch.tensor([t for p, r in pairs for t in p + r], dtype=torch.long),
            seq_offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            prompt_lens=torch.tensor([len(p) for p, _ in pairs], dtype=torch.long),
            topk_ids=torch.cat([t[0] for t in targets]).long(),
            topk_logprobs=torch.cat([t[1] for t in targets]).float(),
            resp_offsets=torch.cat([torch.zeros(1, dtype=torch.long), resp_lengths.cumsum(0)]),
            val_prompts=list(val_prompts),
            train_prompts=[train_prompts[i] for i in keep] if train_prompts else [],
            meta=dict(meta),
        )

    # ---------------------------------------------------------------- views
    @property
    def num_sequences(self) -> int:
        return self.prompt_lens.numel()

    @property
    def num_targets(self) -> int:
        return self.topk_ids.shape[0]

    def sequence(self, b: int) -> torch.Tensor:
        return self.tokens[self.seq_offsets[b] : self.seq_offsets[b + 1]]

    def target_positions(self) -> torch.Tensor:
        """(R,) for each target row, the index into `tokens` of the position it is predicted from."""
        resp = self.resp_offsets[1:] - self.resp_offsets[:-1]  # (n,)
        start = self.seq_offsets[:-1] + self.prompt_lens - 1  # (n,) the last prompt position
        seq_of_row = torch.repeat_interleave(torch.arange(self.num_sequences), resp)  # (R,)
        j = torch.arange(self.num_targets) - self.resp_offsets[:-1][seq_of_row]
        return start[seq_of_row] + j

    def labels(self) -> torch.Tensor:
        """(R,) the token that actually followed each target position (the target's own next token)."""
        return self.tokens[self.target_positions() + 1]

    def rows_left(self) -> torch.Tensor:
        """(R,) how many target rows of the same sequence follow each row (0 for a response's last token):
        a medusa head i may use row r only when rows_left[r] >= i."""
        seq_of_row = torch.repeat_interleave(torch.arange(self.num_sequences), self.resp_offsets[1:] - self.resp_offsets[:-1])
        return self.resp_offsets[1:][seq_of_row] - 1 - torch.arange(self.num_targets)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) how often each token occurs in the responses (for the draft vocabulary)."""
        return torch.bincount(self.labels(), minlength=vocab_size)[:vocab_size]

    # ---------------------------------------------------------------- files
    def save(self, path: Path) -> None:
        # Compact on disk: ids fit int32, log-probabilities fp16 (the loss needs no more).
        payload = {
            "format": FORMAT, "tokens": self.tokens.int(), "seq_offsets": self.seq_offsets,
            "prompt_lens": self.prompt_lens, "topk_ids": self.topk_ids.int(),
            "topk_logprobs": self.topk_logprobs.clamp(min=-60).half(), "resp_offsets": self.resp_offsets,
            "val_prompts": self.val_prompts, "train_prompts": self.train_prompts, "meta": self.meta,
        }
        atomic_torch_save(payload, path)

    @classmethod
    def load(cls, path: Path) -> "Sequences":
        d = torch.load(path, weights_only=True)
        check(d.get("format") == FORMAT, f"{path}: not a selfspec dataset cache (delete it to rebuild)")
        return cls(
            tokens=d["tokens"].long(), seq_offsets=d["seq_offsets"], prompt_lens=d["prompt_lens"],
            topk_ids=d["topk_ids"].long(), topk_logprobs=d["topk_logprobs"].float(), resp_offsets=d["resp_offsets"],
            val_prompts=list(d["val_prompts"]), train_prompts=list(d["train_prompts"]), meta=dict(d["meta"]),
        )


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to a temp file in the same dir, then os.replace: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def file_lock(directory: Path):
    """An exclusive lock on directory/.lock for the duration (parallel jobs building the same cache)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -------------------------------------------------------------------- cache keys
def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_key(model_name: str, fingerprint: dict, dtype: str) -> str:
    return f"{model_name}-{_digest({'fp': fingerprint, 'dtype': dtype})}"


def data_settings(cfg: DataConfig) -> dict:
    """What decides a dataset's content (the feature dtype only names the hidden-state files)."""
    d = asdict(cfg)
    d.pop("feature_dtype")
    if not d["system_prompts"]:  # datasets made before the key existed keep their cache
        d.pop("system_prompts")
    if cfg.source == "jsonl":
        path = Path(cfg.path).expanduser()
        d["path"] = str(path.resolve())
        if path.is_file():  # an edited file is a new dataset
            st = path.stat()
            d["file"] = [st.st_size, int(st.st_mtime)]
        for k in ("num_prompts", "prompt_max_tokens", "prompt_temperature", "prompt_top_p", "system_prompts"):
            d.pop(k, None)
    else:
        for k in ("path", "format", "limit", "use_given"):
            d.pop(k)
    return d


def dataset_dir(root: Path, mkey: str, cfg: DataConfig) -> Path:
    settings = data_settings(cfg)
    return Path(root) / "data" / mkey / f"{cfg.source}-{_digest(settings)}"


# -------------------------------------------------------------------- building
def _given_answers(path: Path, n: int) -> list[str | None]:
    """The first assistant message of each ShareGPT record (None elsewhere), in file order. The file has
    already been validated by load_prompts, so plain json parsing cannot fail here."""
    text = path.read_text(encoding="utf-8-sig")
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        records = [json.loads(line) for line in text.split("\n") if line.strip()]
    out: list[str | None] = []
    for rec in records[:n]:
        answer = None
        for msg in rec.get("conversations") or []:
            if isinstance(msg, dict) and str(msg.get("from", msg.get("role", ""))).lower() in ("gpt", "assistant", "bot", "chatgpt"):
                value = msg.get("value", msg.get("content"))
                answer = value if isinstance(value, str) and value.strip() else None
                break
        out.append(answer)
    return out


def build_sequences(model, cfg: DataConfig, progress: bool = True, directory: Path | None = None) -> Sequences:
    """Synthesize (or read) prompts, have the target answer them, record its soft targets. With a directory,
    the sampled prompts are kept there (prompts.json) as soon as they exist, so a run killed while the
    target answers does not sample them again."""
    from selfspec.training import synthesis

    tok, hf = model.tokenizer, model.hf_model
    eos = model.eos_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    given: list[str | None]
    t0 = time.perf_counter()
    if cfg.source == "selfgen":
        saved = directory / PROMPTS_FILE if directory is not None else None
        if saved is not None and saved.is_file():
            texts = json.loads(saved.read_text())
        else:
            texts = synthesis.sample_prompts(
                hf, tok, cfg.num_prompts + cfg.val_prompts, cfg.prompt_max_tokens, cfg.prompt_temperature,
                cfg.prompt_top_p, cfg.batch_size, cfg.seed, eos, progress, systems=cfg.system_prompts,
            )
            if saved is not None:
                tmp = saved.with_name(f".{saved.name}.tmp{os.getpid()}")
                tmp.write_text(json.dumps(texts, ensure_ascii=False))
                os.replace(tmp, saved)
        check(len(texts) > cfg.val_prompts, f"data=selfgen: only {len(texts)} distinct prompts sampled; need more than data.val_prompts={cfg.val_prompts}")
        given = [None] * len(texts)
    else:
        from selfspec.data import load_prompts

        items = load_prompts(cfg.path, fmt=cfg.format, limit=cfg.limit)
        check(len(items) > cfg.val_prompts, f"data.path={cfg.path}: {len(items)} prompts; need more than data.val_prompts={cfg.val_prompts}")
        texts = [it.turns[0] for it in items]  # single-turn training: the first user turn
        given = [None] * len(items)
        if cfg.use_given:
            from_file = _given_answers(Path(cfg.path), len(items)) if any(not it.reference for it in items) else [None] * len(items)
            # Spec-Bench keeps one reference per turn, joined by blank lines: the first is the first turn's.
            given = [(it.reference.split("\n\n")[0] if it.reference else None) or f for it, f in zip(items, from_file)]
    # Validation prompts come from the end (selfgen: sampled order is random; jsonl: the last records).
    n_train = len(texts) - cfg.val_prompts
    train_texts, val_texts, given = texts[:n_train], texts[n_train:], given[:n_train]

    t1 = time.perf_counter()
    prompt_ids = [model.encode(t, chat=True) for t in train_texts]
    responses: list[list[int] | None] = [None] * n_train
    targets: list = [None] * n_train
    todo = [i for i in range(n_train) if given[i] is None]
    if todo:
        answers = synthesis.answer_prompts(
            hf, [prompt_ids[i] for i in todo], cfg.answer_max_tokens, cfg.answer_temperature, cfg.answer_top_p,
            cfg.batch_size, cfg.seed, eos, pad, cfg.topk, progress,
        )
        for i, a in zip(todo, answers):
            responses[i], targets[i] = a.response, (a.topk_ids, a.topk_logprobs)
    fixed = [i for i in range(n_train) if given[i] is not None]
    if fixed:
        for i in fixed:
            ids = tok(given[i], add_special_tokens=False)["input_ids"][: cfg.answer_max_tokens]
            responses[i] = ids + ([eos[0]] if len(ids) < cfg.answer_max_tokens and eos else [])
        scored = synthesis.score_sequences(model.backbone, [(prompt_ids[i], responses[i]) for i in fixed], cfg.topk, progress=progress)
        for i, t in zip(fixed, scored):
            targets[i] = t
    pairs = [(prompt_ids[i], responses[i]) for i in range(n_train)]
    meta = {"settings": data_settings(cfg), "given": len(fixed), "generated": len(todo), "created": time.time(),
            "prompts_s": t1 - t0, "answers_s": time.perf_counter() - t1}
    return Sequences.from_pairs(pairs, targets, val_texts, train_texts, meta)


def load_or_build(model, cfg: DataConfig, root: Path, model_name: str, progress: bool = True) -> tuple[Sequences, Path, bool]:
    """The cached dataset for (model, cfg), built under a lock when missing. -> (dataset, its dir, was cached)."""
    mkey = model_key(model_name, model.backbone.fingerprint(), str(model.backbone.dtype).removeprefix("torch."))
    directory = dataset_dir(root, mkey, cfg)
    path = directory / DATASET_FILE
    with file_lock(directory):
        if path.is_file():
            try:
                return Sequences.load(path), directory, True
            except (SelfSpecError, RuntimeError, KeyError, EOFError) as exc:  # a stale format: rebuild
                import logging

                logging.getLogger(__name__).warning("rebuilding unreadable dataset cache %s: %s", path, exc)
        data = build_sequences(model, cfg, progress, directory)
        data.save(path)
        (directory / "config.json").write_text(json.dumps(data.meta, indent=2, default=str))
    return data, directory, False
