"""Load evaluation prompts from JSONL / JSON files into one uniform shape.

Three record forms are accepted, detected per record (so a file may mix them):

* Spec-Bench / MT-Bench: ``{"question_id": 81, "category": "writing", "turns": ["...", "..."], "reference": [...]}``
* ShareGPT: ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}, ...]}``
  (only the human/user messages become turns; the model regenerates the assistant side itself)
* Plain: ``{"prompt": "..."}`` or ``{"text": "..."}``, optional ``"category"`` and ``"id"``.

A ``.json`` file (or any file whose first character is ``[``) holding a list of such records is accepted
too, because ShareGPT dumps usually come that way.

Every problem with the input raises :class:`SelfSpecError` with one line that names the file and the
1-based line (or, inside a JSON list, record) number, so a user can jump straight to the bad spot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from selfspec.errors import SelfSpecError

# Allowed values of `data.format`; "auto" detects the form per record.
FORMATS = ("auto", "spec_bench", "sharegpt", "prompt")

# The key that identifies each record form, in detection order. "turns" comes first so that a Spec-Bench
# record that happens to carry an extra "text" field is still read as multi-turn.
_FORMAT_KEYS = {"spec_bench": ("turns",), "sharegpt": ("conversations",), "prompt": ("prompt", "text")}
_ALL_KEYS = ("turns", "conversations", "prompt", "text")

# ShareGPT speaker tags. Dumps in the wild use both the ShareGPT ("from"/"value") and the OpenAI
# ("role"/"content") spellings, so both are read.
_USER_ROLES = {"human", "user"}

DEFAULT_CATEGORY = "default"

_BUILTIN_FILE = "builtin_prompts.jsonl"


@dataclass(frozen=True)
class PromptItem:
    """One evaluation conversation: the user turns to feed the model, one after another.

    `turns` is a tuple (not a list) so that the frozen item is truly immutable and hashable.
    """

    id: str
    category: str
    turns: tuple[str, ...]
    reference: str | None = None
    source_category: str | None = None  # the file's own category when `category` is a task name (Spec-Bench's mt_bench)


# --------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------


def load_prompts(
    path: str | Path,
    fmt: str = "auto",
    limit: int | None = None,
    categories: Sequence[str] | str | None = None,
    key: str = "data",
) -> list[PromptItem]:
    """Read prompts from `path` (JSONL, or JSON list), optionally filtered by category and capped.

    fmt: "auto" (detect per record), or force "spec_bench", "sharegpt" or "prompt".
    limit: keep at most this many items, counted AFTER the category filter; None keeps all.
    categories: keep only these categories; None or empty keeps all. Naming a category the file does not
        have is an error (a typo would otherwise silently evaluate nothing).
    key: the config node that names the file, for error messages (`data` in training, `prompts` in evaluation).
    """
    _check_fmt(fmt)
    _check_limit(limit)
    where = f"{key}.path={path}"
    # With a limit and no category filter only the first `limit` records matter: a JSONL file is then read
    # only as far as they go (a 150 MB file with limit=20 reads 20 lines).
    items = _parse_file(Path(path), where, fmt, stop_after=limit if not categories else None)
    return _select(items, where, limit, categories)


def builtin_prompts(limit: int | None = None, categories: Sequence[str] | str | None = None,
                    key: str = "data") -> list[PromptItem]:
    """The prompt set shipped with the package (Spec-Bench-like task mix, original text)."""
    resource = resources.files("selfspec.data").joinpath(_BUILTIN_FILE)
    # as_file gives a real filesystem path even when the package is installed zipped.
    with resources.as_file(resource) as builtin_path:
        return load_prompts(builtin_path, fmt="spec_bench", limit=limit, categories=categories, key=key)


# --------------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------------


def _check_fmt(fmt: Any) -> None:
    if fmt not in FORMATS:
        raise SelfSpecError(f"data.format={fmt!r}: must be one of {', '.join(FORMATS)}")


def _check_limit(limit: Any) -> None:
    if limit is None:
        return
    # bool is an int subclass; `limit: true` in a config is a mistake, not "1".
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise SelfSpecError(f"data.limit={limit!r}: must be an integer >= 1, or null for all prompts")
    if limit < 1:
        raise SelfSpecError(f"data.limit={limit}: must be >= 1, or null for all prompts")


def _normalize_categories(categories: Sequence[str] | str | None) -> list[str] | None:
    if categories is None:
        return None
    # A bare string is almost certainly one category name; iterating it would filter by single letters.
    if isinstance(categories, str):
        categories = [categories]
    try:
        names = list(categories)
    except TypeError:
        raise SelfSpecError(f"data.categories={categories!r}: must be a list of category names") from None
    for name in names:
        if not isinstance(name, str):
            raise SelfSpecError(f"data.categories={names!r}: every entry must be a string, got {name!r}")
    # An empty list (e.g. `categories: []` in a config) means "no filter", same as null.
    return names or None


# --------------------------------------------------------------------------------------------------
# file reading
# --------------------------------------------------------------------------------------------------


def _read_text(path: Path, where: str) -> str:
    if not path.exists():
        raise SelfSpecError(f"{where}: file not found")
    if path.is_dir():
        raise SelfSpecError(f"{where}: is a directory, expected a .jsonl or .json file")
    raw = path.read_bytes()
    try:
        # utf-8-sig drops a byte-order mark, which some Windows editors put at the start of JSON files.
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SelfSpecError(f"{where} line {line}: not valid UTF-8") from None


def _parse_file(path: Path, where: str, fmt: str, stop_after: int | None = None) -> list[PromptItem]:
    if stop_after is not None and _is_plain_jsonl(path, where):
        records = _jsonl_head_records(path, where, stop_after)
        if not records:
            raise SelfSpecError(f"{where}: no records (the file is empty)")
        return [_to_item(record, where, label, default_id, fmt) for record, label, default_id in records]
    text = _read_text(path, where)
    if not text.strip():
        raise SelfSpecError(f"{where}: no records (the file is empty)")

    if _is_whole_file_json(path, text):
        records = _json_records(text, where)
    else:
        records = _jsonl_records(text, where)

    items = [_to_item(record, where, label, default_id, fmt) for record, label, default_id in records]
    if not items:
        raise SelfSpecError(f"{where}: no records (the JSON list is empty)")
    return items


def _is_whole_file_json(path: Path, text: str) -> bool:
    """Decide between one JSON document (a list of records, or one object) and JSONL.

    A .json file is one document, unless it fails with "Extra data", which is what JSONL content under a
    .json name looks like. Any other file is JSONL, except a pretty-printed list: it starts with "[" and
    its first line alone is not valid JSON. (A one-line list in a .jsonl file stays a JSONL record, so it
    gets a "line 1: record must be a JSON object" error rather than being silently reinterpreted.)
    """
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            return exc.msg != "Extra data"
        return True
    first_line = next(line for line in text.split("\n") if line.strip())
    if not first_line.lstrip().startswith("["):
        return False
    try:
        json.loads(first_line)
    except json.JSONDecodeError:
        return True
    return False


def _is_plain_jsonl(path: Path, where: str) -> bool:
    """Whether `path` can be read line by line: not a .json file, and its first non-blank line does not open
    a pretty-printed JSON list (the rule of _is_whole_file_json, decided from that line alone)."""
    if not path.exists():
        raise SelfSpecError(f"{where}: file not found")
    if path.is_dir():
        raise SelfSpecError(f"{where}: is a directory, expected a .jsonl or .json file")
    if path.suffix.lower() == ".json":
        return False
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8-sig", errors="replace")
            if line.strip():
                if not line.lstrip().startswith("["):
                    return True
                try:
                    json.loads(line)
                except json.JSONDecodeError:
                    return False
                return True
    return True


def _jsonl_head_records(path: Path, where: str, n: int) -> list[tuple[Any, str, str]]:
    """The first n records of a JSONL file as _jsonl_records gives them, reading no further than they go."""
    out: list[tuple[Any, str, str]] = []
    with open(path, "rb") as f:
        for index, raw in enumerate(f):  # lines end at b"\n" only, as in _jsonl_records
            try:
                line = raw.decode("utf-8-sig" if index == 0 else "utf-8")
            except UnicodeDecodeError:
                raise SelfSpecError(f"{where} line {index + 1}: not valid UTF-8") from None
            if not line.strip():
                continue
            label = f"line {index + 1}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SelfSpecError(f"{where} {label}: not valid JSON ({exc.msg})") from None
            out.append((record, label, str(index)))
            if len(out) >= n:
                break
    return out


def _jsonl_records(text: str, where: str) -> list[tuple[Any, str, str]]:
    """Return (record, "line N", default id) per non-blank line; the default id is the 0-based line index."""
    out = []
    # split("\n"), not splitlines(): JSON strings may legally hold raw U+2028 / U+0085, which
    # splitlines() would treat as line breaks and so cut a record in half.
    for index, line in enumerate(text.split("\n")):
        if not line.strip():
            continue  # blank lines (often a trailing newline or two) carry nothing
        label = f"line {index + 1}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SelfSpecError(f"{where} {label}: not valid JSON ({exc.msg})") from None
        out.append((record, label, str(index)))
    return out


def _json_records(text: str, where: str) -> list[tuple[Any, str, str]]:
    """Return (record, "record N", default id) for a whole-file JSON list (or single object)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SelfSpecError(f"{where} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        raise SelfSpecError(f"{where}: expected a JSON list of records, got {type(data).__name__}")
    # Inside a list the line of a record is not known after parsing, so its 1-based position is named
    # instead; the default id is the 0-based position, matching the JSONL "line index" rule.
    return [(record, f"record {i + 1}", str(i)) for i, record in enumerate(data)]


# --------------------------------------------------------------------------------------------------
# record → PromptItem
# --------------------------------------------------------------------------------------------------


def _detect(record: dict, fmt: str, at: str) -> tuple[str, str]:
    """Return (format, key) for this record, honoring a forced `fmt`."""
    wanted = _FORMAT_KEYS if fmt == "auto" else {fmt: _FORMAT_KEYS[fmt]}
    for form, keys in wanted.items():
        for key in keys:
            if key in record:
                return form, key
    if fmt == "auto":
        raise SelfSpecError(f"{at}: record has none of {', '.join(repr(k) for k in _ALL_KEYS)}")
    keys = " or ".join(repr(k) for k in _FORMAT_KEYS[fmt])
    raise SelfSpecError(f"{at}: data.format={fmt} but the record has no {keys}")


def _to_item(record: Any, where: str, label: str, default_id: str, fmt: str) -> PromptItem:
    at = f"{where} {label}"
    if not isinstance(record, dict):
        raise SelfSpecError(f"{at}: record must be a JSON object, got {type(record).__name__}")

    form, key = _detect(record, fmt, at)
    if form == "spec_bench":
        turns = _spec_bench_turns(record[key], at)
        id_keys = ("question_id", "id")
    elif form == "sharegpt":
        turns = _sharegpt_turns(record[key], at)
        id_keys = ("id", "question_id")
    else:
        turns = (_prompt_text(record[key], key, at),)
        id_keys = ("id", "question_id")

    return PromptItem(
        id=_record_id(record, id_keys, default_id, at),
        category=_record_category(record, at),
        turns=turns,
        reference=_record_reference(record.get("reference"), at),
    )


def _spec_bench_turns(turns: Any, at: str) -> tuple[str, ...]:
    if not isinstance(turns, list) or not turns:
        raise SelfSpecError(f"{at}: turns must be a non-empty list of strings")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            kind = type(turn).__name__
            raise SelfSpecError(f"{at}: turns must be a non-empty list of strings (turns[{i}] is {kind})")
        if not turn.strip():
            raise SelfSpecError(f"{at}: turns must be a non-empty list of strings (turns[{i}] is empty)")
    return tuple(turns)


def _sharegpt_turns(conversations: Any, at: str) -> tuple[str, ...]:
    if not isinstance(conversations, list) or not conversations:
        raise SelfSpecError(f"{at}: conversations must be a non-empty list of messages")
    turns = []
    for i, message in enumerate(conversations):
        if not isinstance(message, dict):
            raise SelfSpecError(f"{at}: conversations[{i}] must be an object with 'from' and 'value'")
        speaker = message.get("from", message.get("role"))
        if not isinstance(speaker, str):
            raise SelfSpecError(f"{at}: conversations[{i}] has no 'from' (or 'role') string")
        if speaker.lower() not in _USER_ROLES:
            continue  # assistant / system / tool messages: the model under test produces its own replies
        value = message.get("value", message.get("content"))
        if not isinstance(value, str) or not value.strip():
            raise SelfSpecError(f"{at}: conversations[{i}] is a {speaker} message without a non-empty 'value' string")
        turns.append(value)
    if not turns:
        raise SelfSpecError(f"{at}: conversations has no 'human' or 'user' message")
    return tuple(turns)


def _prompt_text(text: Any, key: str, at: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise SelfSpecError(f"{at}: {key!r} must be a non-empty string")
    return text


def _record_id(record: dict, keys: Sequence[str], default_id: str, at: str) -> str:
    for key in keys:
        if key in record and record[key] is not None:
            value = record[key]
            # ids end up as keys of result files; only scalars stringify to something stable.
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise SelfSpecError(f"{at}: {key!r} must be a string or integer, got {type(value).__name__}")
            return str(value)
    return default_id


def _record_category(record: dict, at: str) -> str:
    category = record.get("category")
    if category is None:
        return DEFAULT_CATEGORY
    if not isinstance(category, str) or not category.strip():
        raise SelfSpecError(f"{at}: 'category' must be a non-empty string")
    return category


def _record_reference(reference: Any, at: str) -> str | None:
    """Flatten a reference answer into one string (it is only shown or scored as text, never parsed).

    Spec-Bench stores one reference per turn, as a list, and its rag items nest a list of acceptable
    answers inside that: per-turn parts are joined by a blank line, alternatives by "; ". Empty entries
    are dropped and an empty result becomes None, so "no reference" has one spelling.
    """
    if reference is None:
        return None
    if isinstance(reference, str):
        return reference or None
    if isinstance(reference, list):
        parts = []
        for part in reference:
            if isinstance(part, list) and all(isinstance(alt, str) for alt in part):
                part = "; ".join(alt for alt in part if alt)
            if not isinstance(part, str):
                break
            if part:
                parts.append(part)
        else:
            return "\n\n".join(parts) if parts else None
    raise SelfSpecError(f"{at}: 'reference' must be a string or a list of strings")


# --------------------------------------------------------------------------------------------------
# filtering
# --------------------------------------------------------------------------------------------------


def _select(
    items: list[PromptItem], where: str, limit: int | None, categories: Sequence[str] | str | None
) -> list[PromptItem]:
    wanted = _normalize_categories(categories)
    if wanted is not None:
        present = list(dict.fromkeys(item.category for item in items))  # file order, no duplicates
        unknown = [name for name in wanted if name not in present]
        if unknown:
            raise SelfSpecError(
                f"data.categories: {', '.join(repr(n) for n in unknown)} not in {where}; "
                f"categories present: {', '.join(present)}"
            )
        keep = set(wanted)
        items = [item for item in items if item.category in keep]
    # limit is applied after the filter so `limit=5, categories=[qa]` means five qa prompts.
    return items if limit is None else items[:limit]
