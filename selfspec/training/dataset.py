"""Training sequences and the full model's soft targets, built once and cached on disk.

A dataset is keyed by the model's fingerprint and the data settings, under
`<cache_dir>/data/<model key>/<data key>/`, so reruns and sweep jobs reuse it:

  prompts.json            selfgen: the sampled prompts (written first: a killed run does not resample them)
  mix/                    data=mix: its stages' prompts and answer shards, kept as they finish (mix/build.py)
  dataset.pt              token ids of every (chat prompt + response), top-k targets at response positions,
                          the held-out validation prompts (sequences.py: Sequences)
  hidden-E<E>-<dtype>.pt  layer-E hidden states of every position (features.py)
  config.json             the settings that made it (for people)
  *.sum                   size + checksum of dataset.pt and each hidden-state file, written with them

Building is guarded by a file lock, so parallel sweep jobs wait for one builder instead of racing. Files
are written atomically and fsync'ed (selfspec.utils.io); a cache file whose checksum no longer matches
(truncated, bit-flipped, replaced) is rebuilt with one warning line. Nothing is unpickled beyond tensors and
plain values (weights_only=True).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from selfspec.data import load_prompts
from selfspec.data.exclude import registered
from selfspec.errors import SelfSpecError, check
from selfspec.training import synthesis
from selfspec.training.config import DataConfig, MixConfig
from selfspec.training.distributed import barrier, broadcast_object, sharding
from selfspec.training.mix.build import Excluder, build_mix, exclude_key
from selfspec.training.sequences import Sequences
from selfspec.training.sharegpt import build_sharegpt, dataset_settings
from selfspec.utils.io import atomic_write_json, checksum_problem, file_lock, safe_name
from selfspec.utils.tensors import safe_torch_load

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.pt"
PROMPTS_FILE = "prompts.json"  # the sampled prompts alone, kept while the answers are being generated


def union(parts: list[Sequences], encode: Callable[[str], list[int]] | None = None) -> tuple[Sequences, list[torch.Tensor]]:
    """Several datasets as one (data.also): the first's validation prompts, and every sequence whose prompt is not one
    of them. A part whose cache records no training prompts (an older cache) is checked by its tokens: a sequence
    that begins with a validation prompt as `encode` chat-encodes it (model.encode(text, chat=True), as the data was
    built) is left out; without `encode` such a part is refused. -> (the union, for each part the token positions of
    it kept, in order: its cached states indexed by them line up with the union's tokens)."""
    first, held_out = parts[0], set(parts[0].val_prompts)
    tokens, seq_lens, prompt_lens, ids, logprobs, resp_lens, prompts, positions, kept = [], [], [], [], [], [], [], [], []
    for i, p in enumerate(parts):
        check(p.topk_ids.shape[1] == first.topk_ids.shape[1],
              f"data.also: datasets keep {first.topk_ids.shape[1]} and {p.topk_ids.shape[1]} top-k targets; set one data.topk")
        named = len(p.train_prompts) == p.num_sequences
        if named:
            seqs = [b for b in range(p.num_sequences) if p.train_prompts[b] not in held_out]
        else:
            check(encode is not None, f"{'data' if i == 0 else f'data.also[{i - 1}]'}: its dataset cache records no "
                                      "training prompts (an older cache), so the first dataset's validation prompts cannot "
                                      "be kept out of it here; delete that cache to rebuild it")
            seqs = _not_starting_with(p, [encode(v) for v in first.val_prompts])
        rows = [torch.arange(int(p.seq_offsets[b]), int(p.seq_offsets[b + 1])) for b in seqs]
        resp = [torch.arange(int(p.resp_offsets[b]), int(p.resp_offsets[b + 1])) for b in seqs]
        empty = torch.zeros(0, dtype=torch.long)
        pos, r = torch.cat(rows or [empty]), torch.cat(resp or [empty])
        positions.append(pos)
        kept.append(len(seqs))
        tokens.append(p.tokens[pos])
        seq_lens += [x.numel() for x in rows]
        resp_lens += [x.numel() for x in resp]
        prompt_lens.append(p.prompt_lens[seqs] if seqs else empty)
        ids.append(p.topk_ids[r])
        logprobs.append(p.topk_logprobs[r])
        if named:
            prompts += [p.train_prompts[b] for b in seqs]
    zero = torch.zeros(1, dtype=torch.long)
    meta = {**first.meta, "also": [{"sequences": n, "left_out": p.num_sequences - n} for p, n in zip(parts[1:], kept[1:])]}
    data = Sequences(
        tokens=torch.cat(tokens), seq_offsets=torch.cat([zero, torch.tensor(seq_lens, dtype=torch.long).cumsum(0)]),
        prompt_lens=torch.cat(prompt_lens), topk_ids=torch.cat(ids), topk_logprobs=torch.cat(logprobs),
        resp_offsets=torch.cat([zero, torch.tensor(resp_lens, dtype=torch.long).cumsum(0)]),
        val_prompts=list(first.val_prompts), train_prompts=prompts if len(prompts) == len(seq_lens) else [], meta=meta)
    return data, positions


def _not_starting_with(data: Sequences, prefixes: list[list[int]]) -> list[int]:
    """The sequences of `data` that begin with none of `prefixes` (token ids; a chat-encoded prompt ends with the
    assistant's header, so a match is a sequence whose first user turn is that prompt, whatever follows it)."""
    by_len: dict[int, set[tuple[int, ...]]] = {}
    for ids in prefixes:
        by_len.setdefault(len(ids), set()).add(tuple(ids))
    tokens, offsets = data.tokens.tolist(), data.seq_offsets.tolist()
    return [b for b in range(data.num_sequences)
            if not any(n <= offsets[b + 1] - offsets[b] and tuple(tokens[offsets[b]:offsets[b] + n]) in group
                       for n, group in by_len.items())]


def load_checked(path: Path, what: str):
    """torch.load(weights_only=True) of a cache file written by atomic_torch_save, or None (after one warning
    line) when it is missing its checksum, no longer matches it, or does not load: the caller rebuilds it."""
    problem = checksum_problem(path)
    if problem is None:
        try:
            return safe_torch_load(path)
        except SelfSpecError:  # an unsafe torch: no file is read, none rebuilt
            raise
        except Exception as exc:  # a file that matches its checksum but not torch's format: rebuild too
            problem = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    log.warning("%s cache %s is damaged or stale (%s); rebuilding it", what, path, problem)
    return None


# errnos that mean "this is not a directory you can write": the hint about SELFSPEC_CACHE helps there, and only there
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENOENT, errno.EISDIR}


def cache_error(directory, exc: OSError) -> SelfSpecError:
    """An OSError on the data cache as one line: the OS's own reason (disk full, I/O error, a stale network mount,
    ...) with its errno name, plus the SELFSPEC_CACHE hint only when the directory itself is not writable."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = f" at {exc.filename}" if exc.filename and str(exc.filename) != str(directory) else ""
    if exc.errno in _NOT_WRITABLE:
        return SelfSpecError(f"data cache {directory}: {reason}{where} (SELFSPEC_CACHE must name a writable directory)")
    return SelfSpecError(f"data cache {directory}: {reason}{where}" + (f" ({name})" if name else ""))


@contextlib.contextmanager
def cache_lock(directory: Path):
    """Hold the lock that guards one dataset directory (its dataset and hidden-state files) for the block. An
    OSError on the way (a read-only or foreign directory, a full disk, a failing network mount) is one line
    with the OS's own reason (cache_error), not a traceback."""
    try:
        with file_lock(Path(directory) / ".lock"):
            yield
    except OSError as exc:
        raise cache_error(directory, exc) from None


# -------------------------------------------------------------------- cache keys
def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_key(model_name: str, fingerprint: dict, dtype: str) -> str:
    """A directory name for (model, weights, dtype); the name part is made path-safe (no `/`, no `..`)."""
    return f"{safe_name(model_name)}-{_digest({'fp': fingerprint, 'dtype': dtype})}"


def data_settings(cfg: DataConfig) -> dict:
    """What decides a dataset's content (the feature dtype only names the hidden-state files)."""
    if cfg.source == "sharegpt":
        return dataset_settings(cfg)
    d = asdict(cfg)
    d.pop("feature_dtype")
    d.pop("also")  # datasets trained on beside this one (each has its own settings and cache)
    d.pop("token_budget", None)  # how generation packs its rows, not what they hold
    d.pop("sharegpt", None)
    if d.get("synth_dtype") == "float32":  # datasets made before these keys existed keep their cache
        d.pop("synth_dtype")
    if d.get("mix") is None:
        d.pop("mix", None)
    else:  # data=mix: answers do not depend on how rows are batched or shards are cut
        d.pop("batch_size")
        d["mix"].pop("shard_prompts", None)
        d["mix"]["exclude"] = exclude_key(cfg.mix)  # what is excluded (content digests), never a path
    if cfg.source == "selfgen":  # sampled prompts pass the default exclusion: Spec-Bench's (fixed: it ships) and
        # every evaluated prompt file, which can grow
        evaluated = sorted(h.digest() for h in registered())
        if evaluated:  # none: the key stays what it was before prompt files were recorded
            d["exclude_evaluated"] = evaluated
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
def _first_records(path: Path, n: int) -> list:
    """The first n records of a prompt file: a JSONL file is read line by line and only as far as needed;
    a whole-file JSON list is parsed whole. The file has already been validated by load_prompts."""
    with open(path, encoding="utf-8-sig") as f:
        records = []
        for line in f:
            if len(records) >= n:
                return records
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # not JSONL: one JSON document (a list of records)
                break
        else:
            return records
    data = json.loads(path.read_text(encoding="utf-8-sig"))
    return (data if isinstance(data, list) else [data])[:n]


def _given_answers(path: Path, n: int) -> list[str | None]:
    """The first assistant message of each ShareGPT record (None elsewhere), in file order."""
    out: list[str | None] = []
    for rec in _first_records(path, n):
        answer = None
        for msg in rec.get("conversations") or []:
            if isinstance(msg, dict) and str(msg.get("from", msg.get("role", ""))).lower() in ("gpt", "assistant", "bot", "chatgpt"):
                value = msg.get("value", msg.get("content"))
                answer = value if isinstance(value, str) and value.strip() else None
                break
        out.append(answer)
    return out


def _read_saved_prompts(path: Path) -> list[str] | None:
    """prompts.json as written by build_sequences, or None (one warning line) when it is damaged."""
    try:
        texts = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(texts, list) and all(isinstance(t, str) for t in texts):
            return texts
        problem = "not a list of strings"
    except (OSError, ValueError) as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    log.warning("sampled prompts %s are damaged (%s); sampling them again", path, problem)
    return None


def build_sequences(model, cfg: DataConfig, progress: bool = True, directory: Path | None = None) -> Sequences:
    """Synthesize (or read) prompts, have the target answer them, record its soft targets. With a directory,
    the sampled prompts are kept there (prompts.json) as soon as they exist, so a run killed while the
    target answers does not sample them again. The dataset's meta starts with the settings that name it."""
    if cfg.source == "mix":  # mix/build.py: sources with contexts, built in resumable stages
        data = build_mix(model, cfg, progress, directory)
    elif cfg.source == "sharegpt":  # training/sharegpt.py: real conversations, teacher-forced, in resumable shards
        data = build_sharegpt(model, cfg, progress, directory)
    else:
        data = _build_answered(model, cfg, progress, directory)
    if data is not None:  # None: a data=sharegpt rank other than 0 (rank 0 assembles the dataset)
        data.meta = {"settings": data_settings(cfg), **data.meta}
    return data


def _build_answered(model, cfg: DataConfig, progress: bool, directory: Path | None) -> Sequences:
    """data=selfgen|jsonl: the prompts (sampled, or read from data.path), the target's answers to them (or the file's
    own, data.use_given) and its soft targets."""
    bb, exact_head = synthesis.synthesis_backbone(model.backbone, cfg.synth_dtype)
    batch = synthesis.BatchSettings(max_batch=cfg.batch_size, token_budget=cfg.token_budget)
    t0 = time.perf_counter()
    if cfg.source == "selfgen":
        texts = _selfgen_prompts(model, cfg, bb, exact_head, batch, progress, directory)
        given: list[str | None] = [None] * len(texts)
    else:
        texts, given = _file_prompts(cfg)
    # Validation prompts come from the end (selfgen: sampled order is random; jsonl: the last records).
    n_train = len(texts) - cfg.val_prompts
    train_texts, val_texts, given = texts[:n_train], texts[n_train:], given[:n_train]

    t1 = time.perf_counter()
    prompt_ids = [model.encode(t, chat=True) for t in train_texts]
    responses, targets, fixed = _answers(model, cfg, bb, exact_head, batch, prompt_ids, given, progress)
    pairs = [(prompt_ids[i], responses[i]) for i in range(n_train)]
    meta = {"given": fixed, "generated": n_train - fixed, "created": time.time(),
            "prompts_s": t1 - t0, "answers_s": time.perf_counter() - t1}
    return Sequences.from_pairs(pairs, targets, val_texts, train_texts, meta)


def _selfgen_prompts(model, cfg: DataConfig, bb, exact_head, batch, progress: bool, directory: Path | None) -> list[str]:
    """data=selfgen: the prompts sampled from the target (Magpie), nothing close to an evaluation prompt; read back
    from directory/prompts.json when an earlier run sampled them, else written there."""
    saved = directory / PROMPTS_FILE if directory is not None else None
    texts = _read_saved_prompts(saved) if saved is not None and saved.is_file() else None
    if texts is None:
        texts = synthesis.sample_prompts(
            bb, model.tokenizer, cfg.num_prompts + cfg.val_prompts, cfg.prompt_max_tokens, cfg.prompt_temperature,
            cfg.prompt_top_p, batch, cfg.seed, model.eos_ids, progress, systems=cfg.system_prompts,
            exclude=Excluder(MixConfig()), exact_head=exact_head,  # nothing close to an evaluation prompt
        )
        if saved is not None:
            atomic_write_json(saved, texts, indent=None, ensure_ascii=False)
    check(len(texts) > cfg.val_prompts, f"data=selfgen: only {len(texts)} distinct prompts sampled; need more than data.val_prompts={cfg.val_prompts}")
    return texts


def _file_prompts(cfg: DataConfig) -> tuple[list[str], list[str | None]]:
    """data=jsonl: the first user turn of each prompt in data.path, and (data.use_given) the file's own answer to
    it, else None."""
    items = load_prompts(cfg.path, fmt=cfg.format, limit=cfg.limit)
    check(len(items) > cfg.val_prompts, f"data.path={cfg.path}: {len(items)} prompts; need more than data.val_prompts={cfg.val_prompts}")
    texts = [it.turns[0] for it in items]  # single-turn training: the first user turn
    given: list[str | None] = [None] * len(items)
    if cfg.use_given:
        from_file = _given_answers(Path(cfg.path), len(items)) if any(not it.reference for it in items) else [None] * len(items)
        # Spec-Bench keeps one reference per turn, joined by blank lines: the first is the first turn's.
        given = [(it.reference.split("\n\n")[0] if it.reference else None) or f for it, f in zip(items, from_file)]
    return texts, given


def _answers(model, cfg: DataConfig, bb, exact_head, batch, prompt_ids: list[list[int]], given: list[str | None],
             progress: bool) -> tuple[list[list[int]], list, int]:
    """Each prompt's response and the target's top-k at its positions: the target's own answer where none is given,
    else the given answer (tokenized, cut at data.answer_max_tokens), scored by the target -> (responses, targets,
    how many were given)."""
    n = len(prompt_ids)
    eos = model.eos_ids
    responses: list[list[int] | None] = [None] * n
    targets: list = [None] * n
    todo = [i for i in range(n) if given[i] is None]
    if todo:
        answers = synthesis.answer_prompts(
            bb, [prompt_ids[i] for i in todo], cfg.answer_max_tokens, cfg.answer_temperature, cfg.answer_top_p,
            batch, cfg.seed, eos, cfg.topk, progress, exact_head=exact_head,
        )
        for i, a in zip(todo, answers):
            responses[i], targets[i] = a.response, (a.topk_ids, a.topk_logprobs)
    fixed = [i for i in range(n) if given[i] is not None]
    if fixed:
        for i in fixed:
            ids = model.tokenizer(given[i], add_special_tokens=False)["input_ids"][: cfg.answer_max_tokens]
            responses[i] = ids + ([eos[0]] if len(ids) < cfg.answer_max_tokens and eos else [])
        scored = synthesis.score_sequences(model.backbone, [(prompt_ids[i], responses[i]) for i in fixed], cfg.topk, progress=progress)
        for i, t in zip(fixed, scored):
            targets[i] = t
    return responses, targets, len(fixed)


def _load_cached(path: Path) -> Sequences | None:
    """The dataset at `path`, or None (after one warning line) when it is missing, damaged or of a stale layout."""
    if not path.is_file():
        return None
    try:
        payload = load_checked(path, "dataset")  # checksum and torch's format first, then the fields
        return Sequences.from_payload(payload, path) if payload is not None else None
    except (SelfSpecError, KeyError, TypeError, AttributeError) as exc:  # a stale layout: rebuild
        log.warning("dataset cache %s has a stale layout (%s); rebuilding it", path, exc)
        return None


def load_or_build(model, cfg: DataConfig, root: Path, model_name: str, progress: bool = True,
                  dist=None) -> tuple[Sequences, Path, bool]:
    """The cached dataset for (model, cfg), built under a lock when missing. -> (dataset, its dir, was cached).

    dist (training.distributed.DistInfo of several ranks; every rank calls this): rank 0 holds the lock and looks
    for the cache; a missing one is built by all ranks together (distributed.sharding: each answers every W-th
    prompt; data=mix: rank 0 chooses each stage's prompts and alone writes the stages and answer shards, see
    mix/build.py) and saved by rank 0, and the others read that file."""
    mkey = model_key(model_name, model.backbone.fingerprint(), str(model.backbone.dtype).removeprefix("torch."))
    directory = dataset_dir(root, mkey, cfg)
    path = directory / DATASET_FILE
    parallel = dist is not None and dist.enabled
    main = not parallel or dist.is_main
    with cache_lock(directory) if main else contextlib.nullcontext():
        data = _load_cached(path) if main else None
        found = broadcast_object(dist, data is not None) if parallel else data is not None
        if found:
            return (data if main else _load_cached(path)), directory, True
        with sharding(dist) if parallel else contextlib.nullcontext():
            built = build_sequences(model, cfg, progress, directory)
        if main:
            # Train on what the cache holds (fp16 log-probabilities), as every later run will: a run that built the
            # data and one that resumes it from the cache must see the same numbers.
            data = Sequences.from_payload(built.save(path), path)
            atomic_write_json(directory / "config.json", data.meta)
        if parallel:
            barrier(dist)
            if not main:  # rank 0's file: the very numbers it trains on
                data = _load_cached(path)
                check(data is not None, f"data cache {path}: rank 0 wrote it, but this rank cannot read it")
    return data, directory, False
