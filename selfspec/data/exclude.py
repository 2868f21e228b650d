"""Evaluation prompts that training data must not contain, kept as content hashes (never the text).

A `PromptHashes` set holds, for every user turn of a prompt set:
- `texts`: the SHA-256 of the turn's normalized text (dedup.normalize: lower case, words only), and
- `grams`: the 8-byte BLAKE2b hashes of the turn's word `ngram`-grams (dedup's hash) that fall in a fixed
  1/`sample` slice of hash space, so the file stays small.
`overlap(text)` is the share of a text's own sampled n-grams found in the set: the same measure as
dedup.TextNgrams.overlap (a training prompt that quotes an evaluation prompt or carries the same article scores
high), estimated on that fixed slice; a text whose normalized form equals an excluded turn scores 1.

Where the sets come from (`data.mix.exclude` and `data.sharegpt.exclude` entries, made absolute when the config is
read: resolve_entries):
- `spec_bench`: Spec-Bench's question.jsonl, shipped with the package (excluded/spec_bench.json), whatever the
  working directory and whether or not the benchmark file is on the machine;
- `evaluated`: every prompt file `python -m selfspec.eval` has been given (`register_eval_prompts`), kept under
  `$SELFSPEC_CACHE/excluded/`;
- a prompt file path: that file's prompts.
Cache keys name a set by its content digest, never by a path.

    python -m selfspec.cli.exclude FILE -o OUT.json [--name NAME]   # writes a hash file (this is how the shipped one was made)
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from selfspec.data.dedup import _h as gram_hash
from selfspec.data.dedup import normalize, words
from selfspec.data.prompts import load_prompts
from selfspec.errors import SelfSpecError
from selfspec.utils.io import atomic_write_json
from selfspec.utils.paths import cache_dir

log = logging.getLogger(__name__)

FORMAT = "selfspec-excluded-prompts/1"
NGRAM = 8
SAMPLE = 16
SHIPPED_DIR = Path(__file__).parent / "excluded"
SHIPPED = ("spec_bench",)  # names of the shipped sets (SHIPPED_DIR/<name>.json)
EVALUATED = "evaluated"  # the `data.mix.exclude` entry for every prompt file given to selfspec.eval


def text_hash(text: str) -> bytes:
    return hashlib.sha256(normalize(text).encode()).digest()


def _sampled(gram_digest: bytes, sample: int) -> bool:
    return int.from_bytes(gram_digest, "big") % sample == 0


def sampled_grams(text: str, ngram: int = NGRAM, sample: int = SAMPLE) -> list[bytes]:
    w = words(text)
    grams = (gram_hash(tuple(w[i : i + ngram])) for i in range(len(w) - ngram + 1))
    return [g for g in grams if _sampled(g, sample)]


def _pack(items: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(sorted(items))).decode()


def _unpack(blob: str, size: int) -> frozenset[bytes]:
    raw = base64.b64decode(blob.encode(), validate=True)
    if len(raw) % size:
        raise ValueError(f"a hash list of {len(raw)} bytes is not made of {size}-byte hashes")
    return frozenset(raw[i : i + size] for i in range(0, len(raw), size))


@dataclass(frozen=True)
class PromptHashes:
    name: str
    texts: frozenset[bytes]
    grams: frozenset[bytes]
    ngram: int = NGRAM
    sample: int = SAMPLE

    @classmethod
    def from_texts(cls, name: str, texts: Iterable[str], ngram: int = NGRAM, sample: int = SAMPLE) -> "PromptHashes":
        texts = [t for t in texts if normalize(t)]
        return cls(name, frozenset(text_hash(t) for t in texts),
                   frozenset(g for t in texts for g in sampled_grams(t, ngram, sample)), ngram, sample)

    @classmethod
    def from_prompt_file(cls, path: str | os.PathLike, name: str | None = None, key: str = "data.mix.exclude") -> "PromptHashes":
        items = load_prompts(Path(path).expanduser(), key=key)
        return cls.from_texts(name or Path(path).stem, [turn for it in items for turn in it.turns])

    def digest(self) -> str:
        """What the set holds (not where it came from): the cache keys' name for it."""
        h = hashlib.sha256(f"{self.ngram}|{self.sample}|".encode())
        for part in (sorted(self.texts), sorted(self.grams)):
            h.update(len(part).to_bytes(8, "big"))
            h.update(b"".join(part))
        return h.hexdigest()[:16]

    def to_json(self) -> dict:
        return {"format": FORMAT, "name": self.name, "normalize": "lower case, words (\\w+) joined by one space",
                "text_hash": "sha256", "ngram": self.ngram, "sample": self.sample, "gram_hash": "blake2b-8",
                "texts": _pack(self.texts), "grams": _pack(self.grams), "digest": self.digest()}

    @classmethod
    def from_json(cls, data: dict, where: str) -> "PromptHashes":
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            out = cls(str(data["name"]), _unpack(data["texts"], 32), _unpack(data["grams"], 8), int(data["ngram"]),
                      int(data["sample"]))
            if out.ngram < 1 or out.sample < 1 or data.get("digest") not in (None, out.digest()):
                raise ValueError("its hashes do not match its digest")
            return out
        except (KeyError, TypeError, ValueError) as exc:
            raise SelfSpecError(f"{where}: not a usable excluded-prompt hash file ({exc})") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PromptHashes":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SelfSpecError(f"{path}: cannot read the excluded-prompt hashes ({exc})") from None
        return cls.from_json(data if isinstance(data, dict) else {}, str(path))

    def merged(self, other: "PromptHashes") -> "PromptHashes":
        if (self.ngram, self.sample) != (other.ngram, other.sample):
            raise ValueError("hash sets of different n-gram sizes or samples do not merge")
        return PromptHashes(f"{self.name}+{other.name}", self.texts | other.texts, self.grams | other.grams,
                            self.ngram, self.sample)

    def __len__(self) -> int:
        return len(self.texts)

    def overlap(self, text: str) -> float:
        """1.0 for a text equal to an excluded turn (normalized); else the share of its sampled n-grams that an
        excluded turn has (0.0 when it has none)."""
        if text_hash(text) in self.texts:
            return 1.0
        grams = sampled_grams(text, self.ngram, self.sample)
        return sum(g in self.grams for g in grams) / len(grams) if grams else 0.0


# ------------------------------------------------------------------------------------------------ where sets live
def shipped(name: str) -> PromptHashes:
    if name not in SHIPPED:
        raise SelfSpecError(f"excluded prompts {name!r}: shipped sets are {', '.join(SHIPPED)}")
    return PromptHashes.load(SHIPPED_DIR / f"{name}.json")


def resolve_entries(entries, key: str) -> list[str]:
    """A config's exclusion entries (`spec_bench`, `evaluated` or prompt files) with every file made absolute now,
    so no later working directory decides what is excluded; a file that is not there is an error naming `key`."""
    named = (*SHIPPED, EVALUATED)
    if not (isinstance(entries, (list, tuple)) and all(isinstance(e, str) and e for e in entries)):
        raise SelfSpecError(f"{key}: must be a list of {', '.join(named)} or prompt file paths")
    out = []
    for entry in entries:
        if entry not in named:
            path = Path(entry).expanduser().resolve()
            if not path.is_file():
                raise SelfSpecError(f"{key}: {entry!r} is not a file ({path}); give a prompt file or one of "
                                    f"{', '.join(named)} (Spec-Bench's prompts ship as hashes: spec_bench)")
            entry = str(path)
        out.append(entry)
    return out


def registry_dir() -> Path:
    return cache_dir() / "excluded"


def registered() -> list[PromptHashes]:
    """The prompt sets selfspec.eval has been given (register_eval_prompts), in a stable order; an unreadable
    entry is skipped with one warning."""
    out = []
    d = registry_dir()
    for path in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            out.append(PromptHashes.load(path))
        except SelfSpecError as exc:
            log.warning("skipping %s", exc)
    return out


def register_eval_prompts(path: str | os.PathLike) -> PromptHashes | None:
    """Remember the prompts of an evaluation prompt file (hashes only) so that data built later leaves them out
    (`data.mix.exclude: [..., evaluated]`). Skipped when a shipped set holds them already. Never fails the
    caller: an unwritable cache is one warning line. -> the registered set, or None."""
    try:
        hashes = PromptHashes.from_prompt_file(path, key="prompts")
        known = {shipped(n).texts for n in SHIPPED}
        if not hashes.texts or any(hashes.texts <= k for k in known):
            return None
        target = registry_dir() / f"{hashes.digest()}.json"
        if not target.is_file():
            atomic_write_json(target, hashes.to_json())
            log.info("%s: its prompts are now excluded from training data built with data.mix.exclude or "
                     "data.sharegpt.exclude [..., %s]", path, EVALUATED)
        return hashes
    except (OSError, SelfSpecError) as exc:
        log.warning("could not record the evaluation prompts of %s for exclusion from training data: %s", path, exc)
        return None
