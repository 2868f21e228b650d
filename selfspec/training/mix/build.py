"""`data=mix`: self-distillation data from a weighted mix of prompt sources, built in resumable stages.

Sources (weights in `data.mix.weights`, shares of `data.num_prompts`; the data.mix keys: training/config.py MixConfig):
  magpie        Magpie prompts sampled from the target (synthesis.sample_prompts, data.system_prompts steer them)
  files         the first turns of prompt files (`data.mix.files`: Spec-Bench `turns`, ShareGPT, `prompt` records)
  documents     requests about documents the target wrote itself (contexts.writing_requests, then
                contexts.document_requests); the documents are trained on too (`train_on_documents`)
  package_docs  installed packages' READMEs and summaries as contexts (contexts.package_prompts)
  code          functions from installed Python source (contexts.code_prompts)
  translation   gettext catalogue sentences, both directions (catalogs.py, contexts.translation_prompts)
  multiturn     a second user turn after the target's first answer (a prompt file's own second turn when it
                has one, else a generic follow-up)
A source with nothing to draw from on this machine (no catalogues, say) gives its share to the others, with
one warning. Every prompt is deduplicated (normalized text), dropped when its chat-encoded length exceeds
`context_max_tokens`, and dropped when it overlaps an evaluation prompt (share of word n-grams >= `exclude_overlap`):
the builtin prompt set and each `exclude` entry, `spec_bench` (Spec-Bench's prompts as content hashes shipped
with the package, data/exclude.py: whatever the working directory), `evaluated` (every prompt file selfspec.eval
has been given) or a prompt file (which must exist). `data.val_prompts` single-turn prompts are held
out, spread over the sources, and nothing made from the same text (group) is trained on.

Stages, each kept under `<dataset dir>/mix/` as it completes, so an interrupted build resumes where it was:
  stage1.json          the first-stage prompts (magpie, files, package_docs, code, translation, document
                       writing requests) and the held-out ones
  answers-documents/   the documents (shards of `shard_prompts` finished answers, written as they finish)
  answers-1/           answers to the first-stage prompts
  stage2.json          requests about the documents and follow-up turns
  answers-2/           their answers
A shard is written atomically with a checksum (selfspec.utils.io) and names the prompt list it belongs to; a
damaged or foreign shard is ignored and its prompts are answered again.

Under torchrun (training/distributed.py `sharding`) every rank builds: rank 0 chooses each stage's prompts and
shares them, every rank answers every W-th of them, and rank 0 alone writes the stage files and the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from pathlib import Path

import torch

from selfspec.data import exclude as ex
from selfspec.data.dedup import TextNgrams, dedup, normalize
from selfspec.data.prompts import builtin_prompts, load_prompts
from selfspec.errors import SelfSpecError, check
from selfspec.training import synthesis
from selfspec.training.config import MixConfig, mix_config
from selfspec.training.distributed import DistInfo, barrier, broadcast_object, current_shard, sharding
from selfspec.training.mix import catalogs, contexts
from selfspec.training.mix.contexts import Prompt
from selfspec.training.sequences import Sequences
from selfspec.utils.io import atomic_write, atomic_write_json, checksum_problem
from selfspec.utils.tensors import safe_torch_load

log = logging.getLogger(__name__)

STAGE1 = ("magpie", "files", "package_docs", "code", "translation")


# ====================================================================================== prompt selection
def allocate(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split `total` prompts over the sources by weight (largest remainders; every source with weight > 0
    and total >= number of such sources gets at least one)."""
    live = {k: w for k, w in weights.items() if w > 0}
    s = sum(live.values())
    exact = {k: total * w / s for k, w in live.items()}
    counts = {k: int(v) for k, v in exact.items()}
    for k in sorted(live, key=lambda k: exact[k] - counts[k], reverse=True)[: total - sum(counts.values())]:
        counts[k] += 1
    return {k: counts.get(k, 0) for k in weights}


class Excluder:
    """Evaluation prompts a training prompt must not overlap (see the module docstring): the builtin set and
    the prompt files of `exclude` by their text, `spec_bench` and `evaluated` by content hashes."""

    def __init__(self, mix: MixConfig):
        self.index = TextNgrams([], mix.exclude_ngram)
        self.threshold = mix.exclude_overlap
        self.files: list[str] = []
        self.hashed: ex.PromptHashes | None = None
        sets = [builtin_prompts()] if mix.exclude_builtin else []
        for entry, hashes in _exclude_sets(mix):
            if hashes is not None:
                self.hashed = hashes if self.hashed is None else self.hashed.merged(hashes)
            else:
                sets.append(load_prompts(Path(entry), key="data.mix.exclude"))
                self.files.append(entry)
        for items in sets:
            for it in items:
                for turn in it.turns:
                    self.index.add(turn)
        self.dropped = 0

    def __call__(self, text: str) -> bool:
        """True when `text` overlaps an excluded prompt (and counts it)."""
        bad = (self.index.size > 0 and self.index.overlap(text) >= self.threshold
               or self.hashed is not None and self.hashed.overlap(text) >= self.threshold)
        self.dropped += bad
        return bad


def _exclude_sets(mix: MixConfig) -> list[tuple[str, object]]:
    """(entry, its PromptHashes) for the hashed entries of data.mix.exclude; (path, None) for prompt files."""
    out: list[tuple[str, object]] = []
    for entry in mix.exclude:
        if entry in ex.SHIPPED:
            out.append((entry, ex.shipped(entry)))
        elif entry == ex.EVALUATED:
            out += [(entry, h) for h in ex.registered()]
        else:
            out.append((entry, None))
    return out


def exclude_key(mix: MixConfig) -> list[str]:
    """What data.mix.exclude excludes, for cache keys: content digests, never a path (the same file reached from
    another directory is the same dataset; an edited one is another)."""
    keys = []
    for entry, hashes in _exclude_sets(mix):
        if hashes is None:
            hashes = ex.PromptHashes.from_prompt_file(entry)
        keys.append(hashes.digest())
    return sorted(set(keys))


def hold_out(prompts: list[Prompt], n: int, rng: random.Random) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out): n single-turn prompts spread over the sources (round robin in a seeded order), and
    every prompt of their groups (or with their text) left out of training."""
    by_source: dict[str, list[Prompt]] = {}
    for p in prompts:
        if len(p.turns) == 1 and p.source != "writing":
            by_source.setdefault(p.source, []).append(p)
    for v in by_source.values():
        rng.shuffle(v)
    val: list[Prompt] = []
    sources = sorted(by_source)
    while len(val) < n and any(by_source.values()):
        for s in sources:
            if by_source[s] and len(val) < n:
                val.append(by_source[s].pop())
    groups, texts = {p.group for p in val}, {normalize(p.text) for p in val}
    return [p for p in prompts if p.group not in groups and normalize(p.text) not in texts], val


# ====================================================================================== sharded answers
def _digest(prompts: list[Prompt], settings: dict) -> str:
    h = hashlib.sha256(json.dumps([[list(p.turns) for p in prompts], settings], sort_keys=True).encode())
    return h.hexdigest()[:16]


def _save_shard(path: Path, digest: str, items: list) -> None:
    payload = {
        "format": "selfspec-mix-shard/1", "digest": digest,
        "index": torch.tensor([i for i, _ in items], dtype=torch.long),
        "lengths": torch.tensor([len(a.response) for _, a in items], dtype=torch.long),
        "finished": torch.tensor([a.finished for _, a in items], dtype=torch.bool),
        "tokens": torch.tensor([t for _, a in items for t in a.response], dtype=torch.long),
        "topk_ids": torch.cat([a.topk_ids for _, a in items]).int(),
        "topk_logprobs": torch.cat([a.topk_logprobs for _, a in items]).clamp(min=-60).half(),
    }
    atomic_write(path, lambda f: torch.save(payload, f), checksum=True)


def _load_shards(directory: Path, digest: str) -> dict:
    """index -> Answer from the valid shards of this prompt list."""
    done = {}
    for path in sorted(directory.glob("shard-*.pt")):
        problem = checksum_problem(path)
        try:
            d = None if problem else safe_torch_load(path)
        except SelfSpecError:  # an unsafe torch: no file is read
            raise
        except Exception as exc:
            problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            d = None
        if d is None or not isinstance(d, dict) or d.get("digest") != digest:
            if d is None:
                log.warning("answer shard %s is damaged (%s); its prompts are answered again", path, problem)
            continue
        offsets = [0, *torch.cumsum(d["lengths"], 0).tolist()]
        for j, i in enumerate(d["index"].tolist()):
            a, b = offsets[j], offsets[j + 1]
            done[i] = synthesis.Answer(d["tokens"][a:b].tolist(), d["topk_ids"][a:b].long(), d["topk_logprobs"][a:b].float(),
                             bool(d["finished"][j]))
    return done


class _ShardWriter:
    """Finished answers of one prompt list into <where>/shard-NNNNN.pt, `size` answers per shard (nothing is written
    without a directory)."""

    def __init__(self, where: Path | None, digest: str, name: str, size: int, total: int):
        self.where, self.digest, self.name, self.size, self.total = where, digest, name, size, total
        self.pending: list = []
        self.added: set[int] = set()
        self.shard_no = self.made = self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, i: int, answer) -> None:
        self.added.add(i)
        self.made += 1
        self.tokens += len(answer.response)
        if self.where is not None:
            self.pending.append((i, answer))
            if len(self.pending) >= self.size:
                self.flush()

    def flush(self) -> None:
        if self.where is None or not self.pending:
            return
        while (self.where / f"shard-{self.shard_no:05d}.pt").exists():
            self.shard_no += 1
        _save_shard(self.where / f"shard-{self.shard_no:05d}.pt", self.digest, self.pending)
        log.info("%s: shard %d saved (%d/%d answers this run, %d answer tokens, %.0f tokens/min)", self.name, self.shard_no,
                 self.made, self.total, self.tokens, self.tokens / max(time.perf_counter() - self.t0, 1e-9) * 60)
        self.pending = []


def answer_sharded(gen, prompt_ids: list[list[int]], prompts: list[Prompt], directory: Path | None, name: str,
                   shard_prompts: int, settings: dict) -> list:
    """Answers to prompt_ids, resumed from and saved to directory/<name>/shard-*.pt as they finish.
    `gen(ids, on_done) -> answers` runs the generation (on_done(j, answer) as each finishes); `settings` (what decides
    the answers) are part of the shards' digest. -> one Answer per prompt.

    Under training.distributed.sharding every rank calls this: each reads the shards (then a barrier, so that all
    agree on what is missing), `gen` answers every W-th missing prompt on each rank and gathers the answers on all,
    and the main rank alone writes shards: its own answers as they finish, the other ranks' after the gather."""
    n = len(prompt_ids)
    if n == 0:
        return []
    shard = current_shard()
    digest = _digest(prompts, settings)
    where = directory / name if directory is not None else None
    done = _load_shards(where, digest) if where is not None and where.is_dir() else {}
    if shard is not None:
        barrier(shard)  # nobody writes a shard before every rank has read them
    todo = [i for i in range(n) if i not in done]
    if done:
        log.info("%s: %d of %d answers found in %s", name, len(done), n, where)
    if todo:
        writer = _ShardWriter(where if shard is None or shard.is_main else None, digest, name, shard_prompts, len(todo))
        answers = gen([prompt_ids[i] for i in todo], lambda j, answer: writer.add(todo[j], answer))
        for j, answer in enumerate(answers):
            done[todo[j]] = answer
            if todo[j] not in writer.added:  # another rank's answer (it has no directory to write to)
                writer.add(todo[j], answer)
        writer.flush()
    return [done[i] for i in range(n)]


# ====================================================================================== the build
def _write_json(path: Path | None, payload) -> None:
    if path is not None:
        atomic_write_json(path, payload, ensure_ascii=False)


def _read_json(path: Path | None):
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s is damaged (%s); building it again", path, str(exc).splitlines()[0] if str(exc) else exc)
        return None


class _MixBuild:
    """One data=mix build: its settings, the writer (the target, or its synthesis copy), the prompts' encodings and
    the exclusion filter, which every stage uses; under training.distributed.sharding, this rank's place."""

    def __init__(self, model, cfg, progress: bool, directory: Path | None):
        self.model, self.cfg, self.progress = model, cfg, progress
        self.mix = mix_config(cfg.mix)
        self.shard = current_shard()  # None: one process
        self.main = self.shard is None or self.shard.is_main
        self.work = Path(directory) / "mix" if directory is not None else None
        if self.work is not None and self.main:
            self.work.mkdir(parents=True, exist_ok=True)
        self.bb, self.exact_head = synthesis.synthesis_backbone(model.backbone, cfg.synth_dtype)
        self.batch = synthesis.BatchSettings(max_batch=cfg.batch_size, token_budget=cfg.token_budget)
        self.max_chars = 4 * self.mix.context_max_tokens  # ~4 characters per token for English; the token limit decides
        self.timings: dict[str, float] = {}
        self._encoded: dict[tuple, list[int]] = {}
        self.excluder = Excluder(self.mix)

    # ---------------------------------------------------------------- shared steps
    def path(self, name: str) -> Path | None:
        return self.work / name if self.work is not None else None

    def encode(self, p: Prompt) -> list[int]:
        if p.turns not in self._encoded:
            self._encoded[p.turns] = self.model.encode(p.messages())
        return self._encoded[p.turns]

    def admissible(self, prompts: list[Prompt]) -> list[Prompt]:
        """Deduplicated, none overlapping an excluded prompt, none longer than context_max_tokens."""
        prompts = dedup(prompts, key=lambda p: "\n".join(p.turns))
        prompts = [p for p in prompts if not self.excluder(p.text) and not (len(p.turns) > 1 and self.excluder(p.turns[0]))]
        return [p for p in prompts if len(self.encode(p)) <= self.mix.context_max_tokens]

    def answers(self, name: str, prompts: list[Prompt], max_tokens: int, temperature: float, top_p: float) -> list:
        """The target's answers to `prompts`, in shards under work/<name>/ (see answer_sharded)."""
        cfg = self.cfg
        settings = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "synth_dtype": cfg.synth_dtype, "topk": cfg.topk, "seed": cfg.seed}

        def gen(ids, on_done):
            return synthesis.generate(self.bb, ids, max_tokens, self.model.eos_ids, temperature=temperature, top_p=top_p,
                                      seed=cfg.seed, topk=cfg.topk, batch=self.batch,
                                      progress=name if self.progress else False, on_done=on_done,
                                      exact_head=self.exact_head)

        return answer_sharded(gen, [self.encode(p) for p in prompts], prompts, self.work, name, self.mix.shard_prompts,
                              settings)

    def on_main(self, fn):
        """fn() on the main rank alone (synthesis inside it unsharded); its result (plain data) on every rank."""
        if self.shard is None:
            return fn()
        with sharding(DistInfo()):
            out = fn() if self.main else None
        return broadcast_object(self.shard, out)

    def stage(self, name: str, choose) -> dict:
        """<work>/<name>.json, or choose() written there when it is missing or damaged (on the main rank)."""

        def read_or_choose() -> dict:
            saved = _read_json(self.path(f"{name}.json"))
            if saved is None:
                saved = choose()
                _write_json(self.path(f"{name}.json"), saved)
            return saved

        return self.on_main(read_or_choose)

    # ---------------------------------------------------------------- stage 1: prompts
    def plan(self, rng: random.Random) -> tuple[dict, list, list]:
        """Prompts per source: data.num_prompts + data.val_prompts split by weight over the sources that have
        something to draw from on this machine. -> (counts, translation pairs, package docs)."""
        cfg, mix = self.cfg, self.mix
        available = dict(mix.weights)
        pairs = []
        if available["translation"] > 0:
            need = int(cfg.num_prompts * available["translation"] / sum(available.values())) + 1
            pairs = catalogs.translation_pairs(tuple(mix.languages), limit=max(2000, 40 * need // len(mix.languages)), rng=rng)
            if not pairs:
                log.warning("data.mix: no gettext catalogues for %s on this machine; the translation share goes to the other sources",
                            ", ".join(mix.languages))
                available["translation"] = 0.0
        docs = contexts.package_docs() if available["package_docs"] > 0 else []
        if available["package_docs"] > 0 and not docs:
            log.warning("data.mix: no package descriptions found; the package_docs share goes to the other sources")
            available["package_docs"] = 0.0
        check(sum(available.values()) > 0, "data.mix: none of the weighted sources has anything to draw from on this machine")
        return allocate(cfg.num_prompts + cfg.val_prompts, available), pairs, docs

    def pool(self, rng: random.Random, counts: dict, pairs: list, docs: list) -> list[Prompt]:
        """Candidate first-stage prompts of each source, about 30% more than its count (room for what dedup, the
        overlap filter and the length limit drop)."""
        cfg, mix, max_chars = self.cfg, self.mix, self.max_chars
        over = 1.3
        pool: list[Prompt] = []
        if counts["files"]:
            file_prompts = []
            for path in mix.files:
                for it in load_prompts(path, key="data.mix.files"):
                    file_prompts.append(Prompt(tuple(it.turns[:1]), "files", it.category, f"file:{path}:{it.id}",
                                               {"second": it.turns[1]} if len(it.turns) > 1 else {}))
            rng.shuffle(file_prompts)
            pool += file_prompts[: int(counts["files"] * over) + 2]
        if counts["package_docs"]:
            pool += contexts.package_prompts(rng, docs, int(counts["package_docs"] * over) + 2, max_chars)
        if counts["code"]:
            functions = contexts.find_functions(rng, int(counts["code"] * over) + 4)
            pool += contexts.code_prompts(rng, functions, int(counts["code"] * over) + 4, max_chars)
        if counts["translation"]:
            pool += contexts.translation_prompts(rng, pairs, int(counts["translation"] * over) + 2, max_chars)
        if counts["magpie"]:
            texts = synthesis.sample_prompts(self.bb, self.model.tokenizer, int(counts["magpie"] * 1.1) + 2,
                                             cfg.prompt_max_tokens, cfg.prompt_temperature, cfg.prompt_top_p, self.batch,
                                             cfg.seed, self.model.eos_ids, self.progress, systems=cfg.system_prompts,
                                             exclude=self.excluder, exact_head=self.exact_head)
            pool += [Prompt((x,), "magpie", "magpie", f"magpie:{i}") for i, x in enumerate(texts)]
        return pool

    def choose_stage1(self) -> dict:
        """stage1.json: the counts per source, the first-stage training prompts, the held-out ones and the
        document writing requests."""
        cfg, mix = self.cfg, self.mix
        rng = random.Random(cfg.seed)
        counts, pairs, docs = self.plan(rng)
        by_source: dict[str, list[Prompt]] = {}
        for p in self.admissible(self.pool(rng, counts, pairs, docs)):
            by_source.setdefault(p.source, []).append(p)
        chosen = [p for s in STAGE1 for p in by_source.get(s, [])[: counts[s]]]
        train1, val = hold_out(chosen, cfg.val_prompts, rng)
        check(len(val) == cfg.val_prompts, f"data.val_prompts={cfg.val_prompts}: only {len(val)} single-turn prompts to hold out")
        n_docs = math.ceil(counts["documents"] / mix.requests_per_document) if counts["documents"] else 0
        writing = contexts.writing_requests(rng, n_docs)
        return {"counts": counts, "train": [p.to_json() for p in train1], "val": [p.to_json() for p in val],
                "writing": [p.to_json() for p in writing]}

    # ---------------------------------------------------------------- stage 2: prompts
    def choose_stage2(self, writing: list[Prompt], doc_answers: list, train1: list[Prompt], answers1: list,
                      counts: dict) -> dict:
        """stage2.json: requests about the documents the target wrote, and follow-up turns after its first answers."""
        tok, mix, max_chars = self.model.tokenizer, self.mix, self.max_chars
        rng = random.Random(self.cfg.seed + 1)
        stage2: list[Prompt] = []
        for p, a in zip(writing, doc_answers):
            text = tok.decode(a.response, skip_special_tokens=True).strip()
            if len(text.split()) >= 40:  # a document worth asking about
                stage2 += contexts.document_requests(rng, text, p, mix.requests_per_document, max_chars)
        stage2 = self.admissible(stage2)[: counts["documents"]]
        firsts = [(p, a, tok.decode(a.response, skip_special_tokens=True).strip()) for p, a in zip(train1, answers1)
                  if len(p.turns) == 1]
        firsts = [f for f in firsts if f[2]]  # an answer with text to follow up on
        rng.shuffle(firsts)  # then a prompt file's own second turns first, then answers that finished
        firsts.sort(key=lambda f: ("second" not in f[0].meta, not f[1].finished))
        follow = [contexts.followup_prompts(rng, p, text, p.meta.get("second"))
                  for p, _, text in firsts[: int(counts["multiturn"] * 1.3) + 2]]
        stage2 += self.admissible(follow)[: counts["multiturn"]]
        return {"train": [p.to_json() for p in stage2]}

    # ---------------------------------------------------------------- the dataset
    def dataset(self, rows: list, val: list[Prompt]):
        """Sequences of (prompt, answer) rows with an answer; the held-out prompts; what each source gave (the
        settings that name the dataset are dataset.build_sequences')."""
        rows = [(p, a) for p, a in rows if a.response]
        check(rows, "data=mix: no training sequences (every answer is empty)")
        pairs = [(self.encode(p), a.response) for p, a in rows]
        targets = [(a.topk_ids, a.topk_logprobs) for _, a in rows]
        per_source: dict[str, list[int]] = {}
        for p, a in rows:
            s = per_source.setdefault(p.source, [0, 0])
            s[0] += 1
            s[1] += len(a.response)
        timings = self.timings
        meta = {"generated": len(rows), "given": 0, "created": time.time(),
                "prompts_s": timings["prompts_s"], "answers_s": timings["answers1_s"] + timings["answers2_s"],
                "mix": {"sources": {k: {"sequences": v[0], "response_tokens": v[1]} for k, v in sorted(per_source.items())},
                        "held_out": {s: sum(p.source == s for p in val) for s in sorted({p.source for p in val})},
                        "excluded_overlap": self.excluder.dropped, "exclude_files": self.excluder.files,
                        "timings": timings}}
        return Sequences.from_pairs(pairs, targets, [p.text for p in val], ["\n\n".join(p.turns) for p, _ in rows], meta)


def build_mix(model, cfg, progress: bool = True, directory: Path | None = None):
    """The Sequences of data=mix (see the module docstring); resumable when `directory` is given.

    Inside training.distributed.sharding every rank calls it: the main rank chooses the prompts of each stage (and
    writes them) and shares them, every rank answers its share of them (answer_sharded), and the main rank alone
    writes the answer shards."""
    b = _MixBuild(model, cfg, progress, directory)
    mix = b.mix
    t = time.perf_counter()
    stage1 = b.stage("stage1", b.choose_stage1)
    train1, val, writing = ([Prompt.from_json(d) for d in stage1[k]] for k in ("train", "val", "writing"))
    counts = stage1["counts"]
    b.timings["prompts_s"] = time.perf_counter() - t
    if b.main:
        log.info("data.mix stage 1: %d prompts, %d documents to write, %d held out (%s)", len(train1), len(writing),
                 len(val), ", ".join(f"{k} {v}" for k, v in counts.items() if v))

    t = time.perf_counter()
    doc_answers = b.answers("answers-documents", writing, mix.document_max_tokens, mix.document_temperature, mix.document_top_p)
    answers1 = b.answers("answers-1", train1, cfg.answer_max_tokens, cfg.answer_temperature, cfg.answer_top_p)
    b.timings["answers1_s"] = time.perf_counter() - t

    t = time.perf_counter()
    stage2 = b.stage("stage2", lambda: b.choose_stage2(writing, doc_answers, train1, answers1, counts))
    train2 = [Prompt.from_json(d) for d in stage2["train"]]
    answers2 = b.answers("answers-2", train2, cfg.answer_max_tokens, cfg.answer_temperature, cfg.answer_top_p)
    b.timings["answers2_s"] = time.perf_counter() - t

    rows = list(zip(train1, answers1)) + list(zip(train2, answers2))
    if mix.train_on_documents:
        rows += list(zip(writing, doc_answers))
    return b.dataset(rows, val)
