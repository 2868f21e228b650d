"""Predicted against measured tau: an analysis run next to an evaluation run of the same head and prompts.

    python -m selfspec.cli.compare outputs/analyze/<time> outputs/eval/<time> [--head LABEL]

Reads analysis.json and the evaluation's summary.json (its `selfspec` method, the K it ran with) and prints a
markdown table per category: the expected tau(K) (from the conditional agreement), the replayed tau(K) (the
engine's schedule on the teacher-forced events) and the measured tau, with their ratios. With dynamic K
(decode.draft_threshold) the comparison is with the analysis's `draft_threshold` replay, when it has one.
"""

from __future__ import annotations

from selfspec.errors import check
from selfspec.utils.markdown import LEFT, RIGHT, table


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def _at(d: dict, K: int):
    """d[K] whether the keys are ints (in memory) or strings (read back from JSON)."""
    return d.get(str(K), d.get(K))


def compare(analysis: dict, summary: dict, head: str | None = None) -> str:
    heads = analysis["heads"]
    check(head is None or head in heads, f"--head={head!r}: not in the analysis; present: {', '.join(heads)}")
    check(head is not None or len(heads) == 1, f"--head: the analysis has several heads ({', '.join(heads)}); name one")
    label = head or next(iter(heads))
    run = summary.get("run") or {}
    K = run.get("draft_len")
    check(isinstance(K, int), "summary.json: no selfspec draft_len (did the evaluation run the selfspec method?)")
    threshold = run.get("draft_threshold")
    h = heads[label]
    rows = []
    groups = [("all", h["overall"], (summary["methods"].get("selfspec") or {}))]
    groups += [(c, v, (summary.get("per_category", {}).get(c) or {}).get("selfspec") or {})
               for c, v in sorted(h["per_category"].items())]
    for name, a, m in groups:
        exp = _at(a["tau"], K)
        rep = (a.get("replay_threshold") if threshold else _at(a["replay"], K)) or {}
        rep = rep.get("tau")
        meas = m.get("tau")
        rows.append([name, str(a["tokens"]), _fmt(exp), _fmt(rep), _fmt(meas),
                     _fmt(exp / meas if exp and meas else None, ".3f"), _fmt(rep / meas if rep and meas else None, ".3f")])
    title = f"Predicted vs measured tau: `{label}`, K={K}" + (f", draft_threshold {threshold}" if threshold else "")
    lines = [f"## {title}", ""]
    lines += table(["category", "tokens", "expected tau", "replayed tau", "measured tau", "expected / measured",
                    "replayed / measured"], rows, [LEFT] + [RIGHT] * 6)
    if threshold and not h["overall"].get("replay_threshold"):
        lines += ["", f"The evaluation used dynamic K; rerun the analysis with draft_threshold={threshold} for a replay."]
    return "\n".join(lines) + "\n"
