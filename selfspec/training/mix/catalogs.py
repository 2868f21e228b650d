"""Sentence pairs for translation requests, from the gettext catalogues that system packages install.

A Linux machine with localised packages carries thousands of human-translated messages under
`/usr/share/locale/<lang>/LC_MESSAGES/*.mo` (coreutils' help texts, apt's messages, ...): English `msgid`
and its German / French / Spanish `msgstr`. `read_mo` parses the binary .mo format itself (GNU gettext's
layout, read with `struct`; nothing is executed or unpickled) and `translation_pairs` keeps the entries that
read like sentences. On a machine without them the translation share of a mix is empty, with one warning.

.mo layout (all integers 32-bit, in the byte order the magic number reveals):
  0  magic 0x950412de        4  revision (major 0 or 1)     8  N strings
  12 offset of the originals table    16 offset of the translations table   (then the hash table, unused)
  each table: N x (length, offset) of a NUL-terminated string; msgctxt is "ctxt\\x04msgid", plural forms
  are NUL-separated inside one string; entry 0 with an empty msgid is the header (its charset applies).
"""

from __future__ import annotations

import glob
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from selfspec.errors import SelfSpecError

MO_MAGIC = 0x950412DE
LOCALE_ROOTS = ("/usr/share/locale", "/usr/local/share/locale")
LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish"}


def read_mo(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(msgid, msgstr) of every translated entry of a .mo file (header, untranslated and undecodable entries
    dropped; a plural entry gives its singular; a context prefix is removed). Bad file -> SelfSpecError."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 20:
        raise SelfSpecError(f"{path}: not a .mo file (only {len(data)} bytes)")
    for order in ("<", ">"):
        if struct.unpack(order + "I", data[:4])[0] == MO_MAGIC:
            break
    else:
        raise SelfSpecError(f"{path}: not a .mo file (bad magic number)")
    revision, n, orig_at, trans_at = struct.unpack(order + "4I", data[4:20])
    if revision >> 16 not in (0, 1):
        raise SelfSpecError(f"{path}: unsupported .mo revision {revision >> 16}")

    def string(table: int, i: int) -> bytes:
        at = table + 8 * i
        if at + 8 > len(data):
            raise SelfSpecError(f"{path}: truncated .mo file (string table entry {i} past the end)")
        length, offset = struct.unpack(order + "2I", data[at : at + 8])
        if offset + length > len(data):
            raise SelfSpecError(f"{path}: truncated .mo file (string {i} past the end)")
        return data[offset : offset + length]

    raw = [(string(orig_at, i), string(trans_at, i)) for i in range(n)]
    charset = "utf-8"
    for msgid, msgstr in raw:
        if msgid == b"":
            found = re.search(rb"charset=([A-Za-z0-9_.:-]+)", msgstr)
            if found:
                charset = found.group(1).decode("ascii")
            break
    out = []
    for msgid, msgstr in raw:
        if not msgid or not msgstr:
            continue
        msgid = msgid.split(b"\x04", 1)[-1].split(b"\x00", 1)[0]
        msgstr = msgstr.split(b"\x00", 1)[0]
        try:
            out.append((msgid.decode("utf-8"), msgstr.decode(charset)))
        except (UnicodeDecodeError, LookupError):
            continue
    return out


def find_catalogs(languages=tuple(LANGUAGES), roots=LOCALE_ROOTS) -> dict[str, list[Path]]:
    """language -> its .mo files under the locale roots (sorted, so a run is reproducible on one machine)."""
    found: dict[str, list[Path]] = {}
    for lang in languages:
        files = []
        for root in roots:
            files += glob.glob(os.path.join(root, lang, "LC_MESSAGES", "*.mo"))
        found[lang] = sorted(Path(f) for f in set(files))
    return found


_FORMAT = re.compile(r"%[-+ #0-9.*]*[a-zA-Z]|\{[^}]*\}|\$\{?\w+")
_MARKUP = re.compile(r"<[^>]+>")


def clean_message(text: str) -> str:
    """A catalogue message as prose: accelerator marks (_File, &Open) and markup removed, whitespace kept
    as the translator wrote it (help texts are multi-line on purpose)."""
    text = _MARKUP.sub("", text).replace("&", "")
    text = re.sub(r"(?<![\w])_(?=\w)", "", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n")).strip()


def looks_like_prose(text: str, min_words: int = 5, max_format: int = 1) -> bool:
    """Sentences, not labels: enough words, mostly letters, at most `max_format` printf / template slots."""
    words = text.split()
    if len(words) < min_words or len(_FORMAT.findall(text)) > max_format:
        return False
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * len(text.replace(" ", "").replace("\n", "")) and not text.lstrip().startswith(("-", "%", "/"))


@dataclass(frozen=True)
class TranslationPair:
    language: str  # "de" | "fr" | "es"
    english: str
    foreign: str
    source: str  # the catalogue, e.g. "coreutils"


def translation_pairs(languages=tuple(LANGUAGES), roots=LOCALE_ROOTS, min_words: int = 5, max_chars: int = 1500,
                      catalogs: dict[str, list[Path]] | None = None, limit: int | None = None,
                      rng=None) -> list[TranslationPair]:
    """Prose-like (english, foreign) pairs from the catalogues, one per distinct English message and language,
    in a stable order (language, catalogue, message). With `limit`, reading stops once a language has that
    many (catalogues visited in `rng`'s shuffled order, else sorted). Unreadable catalogues are skipped."""
    catalogs = catalogs if catalogs is not None else find_catalogs(languages, roots)
    out: list[TranslationPair] = []
    for lang in languages:
        seen: set[str] = set()
        files = list(catalogs.get(lang, []))
        if rng is not None:
            rng.shuffle(files)
        for path in files:
            if limit is not None and len(seen) >= limit:
                break
            try:
                entries = read_mo(path)
            except (SelfSpecError, OSError):
                continue
            for msgid, msgstr in entries:
                en, fo = clean_message(msgid), clean_message(msgstr)
                if limit is not None and len(seen) >= limit:
                    break
                if en in seen or en == fo or len(en) > max_chars or len(fo) > max_chars:
                    continue
                if looks_like_prose(en, min_words) and looks_like_prose(fo, min_words):
                    seen.add(en)
                    out.append(TranslationPair(lang, en, fo, path.stem))
    return out
