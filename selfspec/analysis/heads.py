"""The `heads=` list: which exit heads to score.

An entry is one of
  TYPE        an untrained head of that type at the model's default exit layer   (lens, medusa, ...)
  TYPE@E      the same at exit layer E
  TYPE@A-B    one untrained head per exit layer A..B (inclusive): an agreement-vs-depth scan
  DIR         a saved head directory (from `python -m selfspec.train`)
  default     the head that ships for the model (selfspec/heads/shipped/; refused for a model without one)
Any entry may end in `:full`, `:int8` or `:int4`: the head drafting in that precision (head.draft_precision; the
early layers and the LM head read low-precision copies of the model's weights), e.g. `lens@30:int8`,
`default:int8`, `lens@6-12:int4`. Without it, an untrained head drafts in full precision and a saved one in its own.
Heads are built or loaded only through `selfspec.heads.build_head` / `load_head`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.heads import (build_head, head_spec, head_types as registered, load_head, make_head_config,
                            read_head_config)
from selfspec.heads.base import check_exit_layer
from selfspec.heads.saving import default_shipped_heads, shipped_heads
from selfspec.model.quant import PRECISIONS

_TYPED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:@(.*))?$")


def head_types() -> tuple[str, ...]:
    return registered()


@dataclass(frozen=True)
class HeadEntry:
    entry: str               # as the user wrote it (for TYPE@A-B: expanded to TYPE@E)
    type: str | None = None  # TYPE entries
    exit_layer: int | None = None  # None: the model's default
    path: str | None = None  # DIR entries
    precision: str | None = None  # `:int8` etc.: head.draft_precision (None: the head's own)


def _split_precision(entry: str) -> tuple[str, str | None]:
    """'lens@30:int8' -> ('lens@30', 'int8'); an entry without a precision suffix is returned as it is."""
    base, sep, tail = entry.rpartition(":")
    if sep and base and not Path(entry).exists():
        check(tail in PRECISIONS, f"heads: {entry!r}: unknown precision {tail!r} after ':'; allowed {', '.join(PRECISIONS)}")
        return base, tail
    return entry, None


def _parse_layers(entry: str, spec: str) -> list[int]:
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
    check(m is not None, f"heads: {entry!r}: the exit layer after '@' must be an integer E or a range A-B")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    check(lo <= hi, f"heads: {entry!r}: empty range {lo}-{hi}")
    return list(range(lo, hi + 1))


def parse_heads(entries: list[str]) -> list[HeadEntry]:
    """Syntax and files only (before the model is loaded). Exit layers are checked by `check_exit_layers`."""
    types = head_types()
    check(len(entries) > 0, "heads: give at least one head, e.g. heads=[lens@4,medusa@6,DIR,default]")
    out: list[HeadEntry] = []
    for raw in entries:
        raw = str(raw).strip()
        entry, precision = _split_precision(raw)
        before = len(out)
        _parse_entry(entry, types, out)
        if precision is not None:  # the label keeps the suffix: lens@30:int8 beside lens@30
            out[before:] = [replace(s, entry=f"{s.entry}:{precision}", precision=precision) for s in out[before:]]
    seen: set[str] = set()
    for s in out:
        check(s.entry not in seen, f"heads: {s.entry!r} given twice")
        seen.add(s.entry)
    return out


def _parse_entry(entry: str, types, out: list) -> None:
    """One entry without its precision suffix -> its HeadEntry(s) appended to `out`."""
    if entry == "default" and not Path(entry).is_dir():
        out.append(HeadEntry(entry, path="default"))  # load_head resolves it for the loaded model
        return
    m = _TYPED.match(entry)
    if m and m.group(1) in types and not Path(entry).is_dir():
        t, at = m.group(1), m.group(2)
        if at is None:
            out.append(HeadEntry(entry, type=t))
        else:
            out += [HeadEntry(f"{t}@{e}", type=t, exit_layer=e) for e in _parse_layers(entry, at)]
        return
    if Path(entry).expanduser().is_dir():
        out.append(HeadEntry(entry, path=str(Path(entry).expanduser())))
        return

    if entry in (shipped := shipped_heads()):  # a shipped head by name (heads/saving.py)
        out.append(HeadEntry(entry, path=str(shipped[entry])))
        return
    if m and m.group(2) is not None:
        raise SelfSpecError(f"heads: {entry!r}: unknown head type {m.group(1)!r}; allowed {', '.join(types)}")
    raise SelfSpecError(f"heads: {entry!r}: neither TYPE, TYPE@E or TYPE@A-B (TYPE: {', '.join(types)}) "
                        "nor a head directory")


def check_exit_layers(specs: list[HeadEntry], num_layers: int) -> None:
    for s in specs:
        if s.exit_layer is not None:  # None: the head type's default (heads/base.py: resolve_exit_layer)
            check_exit_layer(s.exit_layer, num_layers, entry=s.entry)


def spec_kind(spec: HeadEntry) -> str:
    """The head's type; for a directory, read from its config (without loading the weights)."""
    if spec.type is not None:
        return spec.type

    if spec.path == "default":  # before the model is known: the shipped heads' type when they share one
        kinds = {str(read_head_config(p)["type"]) for p in default_shipped_heads().values()}
        return kinds.pop() if len(kinds) == 1 else "default"
    try:
        return str(read_head_config(spec.path)["type"])
    except SelfSpecError as exc:
        raise SelfSpecError(f"heads: {spec.entry!r}: {exc}")


def build(spec: HeadEntry, model):
    """The ExitHead for one entry on `model` (a SelfSpecModel): untrained via build_head, saved via load_head."""
    try:
        if spec.path is not None:
            return load_head(spec.path, model.backbone).set_draft_precision(spec.precision)
        return build_head(make_head_config(spec.type, exit_layer=spec.exit_layer, draft_precision=spec.precision),
                          model.backbone, model.eos_ids)
    except SelfSpecError as exc:
        raise SelfSpecError(f"heads: {spec.entry!r}: {exc}")


def changes_model(spec: HeadEntry) -> bool:
    """Whether heads of this entry's type change the model's early layers (LoRA: `reuses_early_layers` False)."""
    if spec.path == "default":  # the shipped heads' types, before the model (and so which of them) is known
        kinds = {str(read_head_config(p)["type"]) for p in default_shipped_heads().values()}
        return any(not head_spec(k).head_class.reuses_early_layers for k in kinds)
    return not head_spec(spec_kind(spec)).head_class.reuses_early_layers


def split_lora(specs: list[HeadEntry]) -> tuple[list[HeadEntry], list[HeadEntry]]:
    """(heads that leave the model alone, heads that change its early layers: LoRA). A model carries one
    LoRA, and injecting it sends the early layers through HF's slower layer code, so such a head is scored and
    timed after all the others."""
    lora = [s for s in specs if changes_model(s)]
    check(len(lora) <= 1, f"heads: at most one head that changes the model (lora) per run; got "
                          f"{', '.join(s.entry for s in lora)}")
    return [s for s in specs if s not in lora], lora
