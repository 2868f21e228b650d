"""The project's published results: the result records in `results/` (evaluation/record.py), rendered into the
README's results table and BENCHMARKS.md's "Where things stand" section. Tables are rendered from the files, never
typed by hand; `python -m selfspec.cli.results --write` refreshes both documents and `--check` (a test runs it)
fails when either differs from its records.

Each record contributes one row per method other than its reference: model, CPU, the setting, tokens/s, the ratio
to the reference with its 95% bootstrap interval over prompts, tau and lossless.
"""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.errors import SelfSpecError, check
from selfspec.evaluation.record import check_record
from selfspec.utils.markdown import table

BEGIN, END = "<!-- results:begin (rendered by python -m selfspec.cli.results; do not edit) -->", "<!-- results:end -->"
MAX_RECORD_BYTES = 4 << 20

# What each method string of the standard runs means, in the table's words; other methods show as written.
SETTINGS = {
    "selfspec:lookup=false": "the default head alone (lookup off)",
    "selfspec": "the default head, lookup first",
    "selfspec:draft_precision=int8": "the default head in int8, lookup first",
    "selfspec:draft_precision=int4_mlp": "the default head in int4_mlp, lookup first",
    "selfspec:draft_precision=int4_a8:lookup=false": "the default head in int4_a8 alone",
    "selfspec:draft_precision=int4_a8": "the default head in int4_a8, lookup first",
    "selfspec:draft_precision=int4_mlp_a8:lookup=false": "the default head in int4_mlp_a8 alone",
    "selfspec:draft_precision=int4_a8:draft_len=8:lookup=false": "the default head in int4_a8 alone, K=8",
    "selfspec:head=smollm2_135m+context:draft_len=2:draft_continue=0.5:lookup=false": "the best trained head alone",
    "selfspec:head=smollm2_135m+context:draft_len=2:draft_continue=0.5": "the best trained head, lookup first",
    "lookup": "context lookup alone (no head)",
    "selfspec:draft_precision=int8_a8:lookup=false": "the default head in int8_a8 alone",
    "selfspec:head=outputs/train/lowbit_offgrid_r16/head:lookup=false": "make train's trained int4_a8 draft alone",
    "selfspec:head=outputs/train/lowbit_offgrid_r16/head:lookup=true:lookup_mode=first":
        "make train's trained int4_a8 draft, lookup first",
}
# The README's one-screen table: these methods, each from the newest record of its model that ran it (the draft
# column says what the default head drafted in then); BENCHMARKS.md renders every row of every record.
README_METHODS = ("selfspec:lookup=false", "selfspec", "selfspec:draft_precision=int4_a8:lookup=false",
                  "selfspec:draft_precision=int4_a8", "selfspec:head=smollm2_135m+context:draft_len=2:draft_continue=0.5")
ORDER = list(SETTINGS)


def is_testbed(rec: dict) -> bool:
    """A record of a testbed copy of a model (model.off_grid: its cache name ends in -offgrid<x>), not of the model as
    users load it: BENCHMARKS.md shows it, the README's one-screen table does not."""
    return "-offgrid" in str(rec.get("model", {}).get("name", ""))


def load_records(directory: Path) -> list[tuple[str, dict]]:
    """(file name, record) for every results/*.json, sorted by name; a file that is not a valid record fails with
    one line naming it."""
    check(directory.is_dir(), f"results: {directory} is not a directory")
    out = []
    for path in sorted(directory.glob("*.json")):
        check(path.stat().st_size <= MAX_RECORD_BYTES, f"results: {path.name} is over {MAX_RECORD_BYTES >> 20} MB")
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SelfSpecError(f"results: {path.name} is not valid JSON ({exc})") from None
        check_record(rec, f"results: {path.name}")
        out.append((path.name, rec))
    return out


def cpu_label(cpu: dict) -> str:
    """e.g. "AMD EPYC (model 17; AVX-512, VNNI)": the model name and number and what decides the kernels."""
    flags = set(cpu.get("flags") or [])
    feats = ["AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None,
             "VNNI" if flags & {"avx512_vnni", "avx_vnni"} else None, "AMX" if "amx_int8" in flags else None]
    detail = "; ".join(x for x in [f"model {cpu['model']}" if cpu.get("model") is not None else None,
                                   ", ".join(f for f in feats if f)] if x)
    return f"{cpu.get('model_name', 'unknown')} ({detail}), {cpu.get('cores', '?')} cores"


def draft_label(head: dict | None, layers: int | None) -> str:
    """What drafted, e.g. "lens E=30 int4_mlp" or "context E=2"; "-" without a head."""
    if not head or not head.get("type"):
        return "-"
    prec = head.get("draft_precision")
    return f"{head['type']} E={head.get('exit_layer')}" + (f" {prec}" if prec and prec != "full" else "")


def _ratio(m: dict) -> str:
    if m.get("speedup") is None:
        return "-"
    ci = m.get("speedup_ci95")
    return f"**{m['speedup']:.2f}x**" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def _rows(records: list[tuple[str, dict]], with_name: bool = False) -> list[tuple]:
    rows = []
    for name, rec in records:
        ref = rec["reference"]
        prompts = rec["prompts"]
        where = f"{prompts.get('count', '?')} prompts" + (" (busy)" if rec.get("busy") else "")
        for method, m in rec["methods"].items():
            if method == ref:
                continue
            setting = SETTINGS.get(method, f"`{method}`")
            lossless = "-" if m.get("lossless") is None else f"{100 * m['lossless']:.0f}%"
            cpu = cpu_label(rec["machine"]["cpu"])
            key = (rec["model"]["name"], cpu, ORDER.index(method) if method in ORDER else len(ORDER), method)
            cells = [rec["model"]["name"], cpu, setting, draft_label(m.get("head"), rec["model"].get("layers")),
                     _ratio(m), f"{m['tau']:.2f}" if m.get("tau") is not None else "-", lossless,
                     f"[{where}](results/{name})"]
            rows.append((key, cells, name) if with_name else (key, cells))
    return sorted(rows, key=lambda r: r[0])


def render_table(records: list[tuple[str, dict]], link_prefix: str = "", newest_of: tuple[str, ...] | None = None) -> str:
    """The results table (markdown), one row per (record, method other than the reference); with `newest_of`, only
    those methods, each from the newest record (by its creation time) of its model that ran it (the README's)."""
    picked = _rows(records)
    if newest_of is not None:
        created = {name: rec.get("created", "") for name, rec in records}
        best: dict[tuple, tuple] = {}
        for key, cells, name in sorted(_rows(records, with_name=True), key=lambda r: created[r[2]]):
            if key[3] in newest_of:
                best[(key[0], key[3])] = (key, cells)
        picked = sorted(best.values(), key=lambda r: r[0])
    rows = [[c.replace("](results/", f"]({link_prefix}results/") for c in cells] for _, cells in picked]
    return "\n".join(table(["model", "CPU", "setting", "draft", "vs our AR path (95% interval)", "tau", "lossless",
                            "record"], rows)) + "\n"


def render_sources(records: list[tuple[str, dict]]) -> str:
    """BENCHMARKS.md's list of where each record came from: date, commit, thread policy and the command."""
    lines = []
    for name, rec in records:
        code = rec.get("code") or {}
        commit = (code.get("commit") or "unknown")[:7] + (" + uncommitted changes" if code.get("dirty") else "")
        threads = (rec["machine"].get("threads") or {})
        load = threads.get("mean_other_load_cores")
        argv = " ".join(_quote(a) for a in (rec.get("command") or {}).get("argv", []))
        lines.append(f"- `{name}`: {rec.get('created', '?')}, commit {commit}, "
                     f"{rec['machine'].get('software', {}).get('torch', '?')}, {threads.get('limit', '?')} threads"
                     + (f", other processes' load {load} cores" if load is not None else "")
                     + f", prompts sha256 {rec['prompts'].get('sha256', '?')[:12]}:\n  `{argv}`")
    return "\n".join(lines) + "\n"


def _quote(arg: str) -> str:
    return f"'{arg}'" if any(c in arg for c in " []\"*{}") else arg


def replace_region(text: str, rendered: str, where: str) -> str:
    """`text` with the part between BEGIN and END replaced by `rendered`."""
    check(text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END),
          f"{where}: needs exactly one '{BEGIN}' ... '{END}' region")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{rendered}{END}{tail}"


def region(text: str) -> str:
    """What lies between BEGIN and END (without the markers' own lines)."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")
