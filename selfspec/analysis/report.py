"""analysis.md and the PNG figures, from the dict that analysis.json holds."""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

from selfspec.utils.markdown import LEFT, RIGHT, table
from selfspec.utils.io import atomic_write


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    return table(header, rows, align or [LEFT] + [RIGHT] * (len(header) - 1))


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if _missing(x) else f"{x:{spec}}{suffix}"


def _pct(x) -> str:
    return "-" if _missing(x) else f"{100.0 * x:.1f}%"


def _count(n: int | None) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n is not None and n >= scale:
            return f"{n / scale:.2f}{unit}"
    return "-" if n is None else str(n)


def _row_label(label: str) -> str:
    return f"`{label}`"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless: analyses run on cluster nodes
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: str | os.PathLike) -> Path:
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    finally:
        _pyplot().close(fig)


def analysis_markdown(result: dict) -> str:
    heads: dict[str, dict] = result["heads"]
    run = result["run"]
    ks = [int(k) for k in run["draft_lens"]]
    k_show = 4 if 4 in ks else ks[-1]  # the K of the one-K columns
    lines = [f"# Draft analysis: {run['model']}", "",
             f"{run['prompts']} prompts ({run['sequences']} turns, {run['answer_tokens']} answer tokens, "
             f"max_new_tokens {run['max_new_tokens']}), teacher-forced on the target's own greedy answers "
             f"({'cached' if run['answers_cached'] else 'generated'}: `{run['answers_file']}`).", ""]
    if run.get("target_mismatch"):
        lines += [f"Note: at {run['target_mismatch']} answer positions the one-pass forward's argmax differs from "
                  "the engine's token (float rounding); the answer token counts as the truth.", ""]
    costs = run.get("costs")
    lines += _heads_section(heads, [int(k) for k in run["topk"]], k_show, costs)
    lines += _tau_sections(heads, ks)
    if costs:
        lines += _costs_section(heads, ks, costs)
    lines += _parallel_section(heads, ks, costs)
    lines += _lookup_first_section(heads, ks)
    lines += _category_sections(heads, k_show)
    return "\n".join(lines) + "\n"


def _heads_section(heads: dict, topk: list[int], k_show: int, costs: dict | None) -> list[str]:
    """One row per head: type, E, draft precision, trained or not, size, top-k coverage, KL, tau at k_show (and with
    costs: c, best K, speedup): an E x precision x (trained, untrained) table when the list has them."""
    lines = ["## Heads", ""]
    header = ["head", "type", "E", "precision", "trained", "params", *[f"top-{k}" for k in topk], "KL", f"tau K={k_show}"]
    if costs:
        header += ["c", "best K", "predicted speedup"]
    rows = []
    for label, h in heads.items():
        o = h["overall"]
        row = [_row_label(label), h["type"], str(h["exit_layer"]), h.get("precision", "full"),
               "no" if h.get("source", "untrained") == "untrained" else "yes", _count(h["params"]),
               *[_pct(o["coverage"][k]) for k in topk], _fmt(o["kl"], ".3f"), _fmt(o["tau"][k_show], ".2f")]
        if costs:
            p = h["predicted"]
            row += [_fmt(h["draft_cost"], ".3f"), str(p["best"]["draft_len"]), _fmt(p["best"]["speedup"], ".2f", "x")]
        rows.append(row)
    lines += _table(header, rows, align=[LEFT, LEFT, RIGHT, LEFT, LEFT] + [RIGHT] * (len(header) - 5))
    if any(h["overall"].get("outside") for h in heads.values()):
        lines += ["", "Target mass outside a reduced draft vocabulary: " + ", ".join(
            f"`{label}` {_pct(h['overall']['outside'])}" for label, h in heads.items() if h["overall"].get("outside")) + "."]
    return lines


def _tau_sections(heads: dict, ks: list[int]) -> list[str]:
    """Conditional agreement by draft position, expected and replayed tau by K, and dynamic K's replayed tau."""
    pos = len(heads and next(iter(heads.values()))["overall"]["conditional"])
    lines = ["", "## Conditional agreement by draft position", "",
             "a_j = P(draft j+1 right | drafts 1..j right), over every start position in the answers.", ""]
    lines += _table(["head"] + [str(j + 1) for j in range(pos)],
                    [[_row_label(label)] + [_pct(a) for a in h["overall"]["conditional"]] for label, h in heads.items()])
    lines += ["", "## Expected tau by K", "", "tau(K) = 1 + sum_{i=1..K} prod_{j<i} a_j (new tokens per verify step).", ""]
    lines += _table(["head"] + [f"K={k}" for k in ks],
                    [[_row_label(label)] + [_fmt(h["overall"]["tau"][k], ".2f") for k in ks] for label, h in heads.items()])
    lines += ["", "## Replayed tau by K", "",
              "The engine's greedy fixed-K schedule replayed on the same events: what `python -m selfspec.eval` "
              "measures for this head, K, prompts and max_new_tokens.", ""]
    lines += _table(["head"] + [f"K={k}" for k in ks],
                    [[_row_label(label)] + [_fmt(h["overall"]["replay"][k]["tau"], ".2f") for k in ks]
                     for label, h in heads.items()])
    thr = [(label, h["overall"]["replay_threshold"]) for label, h in heads.items() if h["overall"].get("replay_threshold")]
    if thr:
        lines += ["", f"Dynamic K (draft_threshold {thr[0][1]['threshold']}, at most K={thr[0][1]['draft_len']}), "
                      "replayed tau: " + ", ".join(f"`{label}` {_fmt(r['tau'], '.2f')}" for label, r in thr) + "."]
    cont = [(label, h["overall"]["replay_continue"]) for label, h in heads.items() if h["overall"].get("replay_continue")]
    if cont:
        lines += ["", f"Joint-confidence K (decode.draft_continue={cont[0][1]['threshold']}): every round drafts once, and on "
                      "while the product of its drafts' top-1 probabilities stays at or above the threshold; replayed tau, "
                      "at most K:", ""]
        lines += _table(["head"] + [f"K={k}" for k in ks],
                        [[_row_label(label)] + [_fmt(r["by_k"][k]["tau"], ".2f") for k in ks] for label, r in cont])
    return lines


def _costs_section(heads: dict, ks: list[int], costs: dict) -> list[str]:
    """Predicted speedup by K from the measured step costs, and the verify costs behind it."""
    lines = ["", "## Predicted speedup over our autoregressive path", "",
             "S(K) = tau(K) / (K c + v(K)); c and v in autoregressive steps "
             f"({costs['ar_step_s'] * 1e3:.2f} ms at a {costs['context']}-token context, median of {costs['repeats']}).", ""]
    lines += _table(["head"] + [f"K={k}" for k in ks],
                    [[_row_label(label)] + [_fmt(h["predicted"]["speedup"][k], ".2f", "x") for k in ks]
                     for label, h in heads.items()])
    fit = costs.get("prefill_fit")
    if fit and all(h["predicted"].get("end_to_end") for h in heads.values()):
        lines += ["", "End to end, as `selfspec.eval` measures it: the prompts' prefill (timed, fitted as "
                  f"{fit['a'] * 1e3:.3f} ms x P + {fit['b'] * 1e6:.4f} us x P^2) counts for both paths:", ""]
        lines += _table(["head"] + [f"K={k}" for k in ks],
                        [[_row_label(label)] + [_fmt(h["predicted"]["end_to_end"][k], ".2f", "x") for k in ks]
                         for label, h in heads.items()])
    lines += ["", "Verify cost v(K) over K+1 rows:", ""]
    lines += _table(["verify"] + [f"K={k}" for k in ks],
                    [[("full stack" if key == "full" else f"reuse E={key}")] + [_fmt(v[k], ".3f") for k in ks]
                     for key, v in costs["verify"].items()])
    return lines


def _parallel_section(heads: dict, ks: list[int], costs: dict | None) -> list[str]:
    """Heads that propose several drafts per pass (decode.tokens_per_pass): their agreement, tau and speedup."""
    par = {label: h["parallel"] for label, h in heads.items() if h.get("parallel")}
    if not par:
        return []
    lines = ["", "## Several drafts per pass (decode.tokens_per_pass)", "",
             "A medusa head's extra heads propose drafts 2..m from the pass that proposes draft 1: m drafts per "
             "pass through layers < E. Offset agreement: extra head i's top-1 against the token i after the "
             "first draft's. Tau and the predicted speedup are those of rounds with m drafts per pass "
             "(a round of K drafts makes ceil(K/m) passes of cost c_m).", ""]
    header = ["head", "m", "offset agreement (2..m)", "c_m", *[f"tau K={k}" for k in ks]]
    rows = [[_row_label(label), str(p["tokens_per_pass"]),
             " / ".join(_pct(a) for a in p["overall"]["ahead_agreement"]), _fmt(p.get("draft_cost"), ".3f"),
             *[_fmt(p["overall"]["tau"][k], ".2f") for k in ks]] for label, p in par.items()]
    lines += _table(header, rows, align=[LEFT] + [RIGHT] * (len(header) - 1))
    if costs:
        lines += ["", "Predicted speedup over our autoregressive path with m drafts per pass:", ""]
        lines += _table(["head"] + [f"K={k}" for k in ks],
                        [[_row_label(label)] + [_fmt(p["predicted"]["speedup"][k], ".2f", "x") for k in ks]
                         for label, p in par.items()])
    return lines


def _lookup_first_section(heads: dict, ks: list[int]) -> list[str]:
    """Rounds under decode.lookup_mode=first, replayed: tau, lookup's share of rounds, predicted speedups by K."""
    with_lookup = {label: h["lookup_first"] for label, h in heads.items() if h.get("lookup_first")}
    if not with_lookup:
        return []
    st = next(iter(with_lookup.values()))["settings"]
    lines = ["", "## Lookup first (decode.lookup_mode=first)", "",
             f"Context lookup's chain of up to {st['len']} tokens (matches of {st['min_ngram']}-{st['max_ngram']} tokens) "
             "where the history matches, the head's K drafts elsewhere; the engine's rounds replayed on the answers. "
             "Rows: replayed tau, lookup's share of rounds, predicted speedup (decode only, and end to end with the "
             "prefill) by K.", ""]
    rows = []
    for label, lf in with_lookup.items():
        rows.append([f"{_row_label(label)} tau"] + [_fmt(lf["replay"][k]["tau"], ".2f") for k in ks])
        rows.append([f"{_row_label(label)} lookup rounds"] + [_pct(lf["replay"][k]["lookup_rounds"]) for k in ks])
        if lf.get("speedup"):
            rows.append([f"{_row_label(label)} speedup"] + [_fmt(lf["speedup"][k], ".2f", "x") for k in ks])
            rows.append([f"{_row_label(label)} end to end"] + [_fmt(lf["end_to_end"][k], ".2f", "x") for k in ks])
    return lines + _table(["head"] + [f"K={k}" for k in ks], rows)


def _category_sections(heads: dict, k_show: int) -> list[str]:
    """Top-1 agreement and expected tau by prompt category (when the prompts have more than one)."""
    cats = sorted({c for h in heads.values() for c in h["per_category"]})
    if len(cats) <= 1:
        return []
    lines = ["", "## Top-1 agreement by category", ""]
    lines += _table(["category", "tokens"] + [_row_label(label) for label in heads],
                    [[c, str(next(iter(heads.values()))["per_category"][c]["tokens"])]
                     + [_pct(h["per_category"][c]["agreement"]) for h in heads.values()] for c in cats])
    lines += ["", f"## Expected tau at K={k_show} by category", ""]
    lines += _table(["category"] + [_row_label(label) for label in heads],
                    [[c] + [_fmt(h["per_category"][c]["tau"][k_show], ".2f") for h in heads.values()] for c in cats])
    return lines


# ------------------------------------------------------------------------------------------------ plots
def plot_agreement_vs_exit_layer(result: dict, path: str | os.PathLike) -> Path:
    """Top-1 agreement over E, one line per head type (trained heads apart from untrained ones)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for h in result["heads"].values():
        name = h["type"] + (" (trained)" if h["source"] != "untrained" else "")
        lines[name].append((h["exit_layer"], h["overall"]["agreement"]))
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([e for e, _ in pts], [a for _, a in pts], marker="o", label=name)
    ax.set_xlabel("exit layer E")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("top-1 agreement (teacher-forced)")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"Agreement vs exit layer: {result['run']['model']}")
    return _save_figure(fig, path)


def plot_by_draft_len(result: dict, key: str, path: str | os.PathLike) -> Path:
    """One line per head over K: key = "speedup" (predicted, a line at 1.0) or "tau" (expected)."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for label, h in result["heads"].items():
        series = h["predicted"]["speedup"] if key == "speedup" else h["overall"]["tau"]
        ks = sorted(int(k) for k in series)
        ax.plot(ks, [series[k] for k in ks], marker="o", label=label)
    if key == "speedup":
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1.0, label="autoregressive (1.0)")
        ax.set_ylabel("predicted speedup over our autoregressive path")
    else:
        ax.set_ylabel("expected tau (tokens per verify step)")
    ax.set_xlabel("draft length K")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(("Predicted speedup" if key == "speedup" else "Expected tau") + f" vs K: {result['run']['model']}")
    return _save_figure(fig, path)
