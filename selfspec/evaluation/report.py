"""Summary numbers and markdown for evaluation runs and (E, K) sweeps.

Everything here is pure: inputs are plain dicts/lists (as loaded from JSON), outputs are dicts and strings.
Writing files is left to the callers (see `selfspec.evaluation.plots.write_sweep_report`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from selfspec.decoding.stats import pool_stats
from selfspec.errors import check
from selfspec.utils.markdown import LEFT, RIGHT, table

# The tests that check sampling's exactness (a sampled evaluation does not compare outputs token for token).
SAMPLING_TESTS = (
    "tests/test_sampling.py, tests/decoding/test_tree.py, tests/decoding/test_tree_engine.py, tests/decoding/test_lookup_first.py, "
    "tests/decoding/test_fused_chain.py, tests/decoding/test_context_engine.py")

__all__ = [
    "expected_tau",
    "predicted_speedup",
    "alpha_from_accept_rate_per_position",
    "cost_ratios",
    "summarize_methods",
    "summary_markdown",
    "sweep_grid",
    "aggregate_sweep",
]


# --------------------------------------------------------------------------------------------------------------
# Analytic model (Leviathan et al. 2023, Thm 3.8, with a separate verify cost)
# --------------------------------------------------------------------------------------------------------------


def _is_number(x: Any) -> bool:
    # bool is an int subclass; a True/False slipping in as a rate or a cost is always a bug upstream.
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_alpha_k(alpha: float, draft_len: int) -> None:
    check(_is_number(alpha) and math.isfinite(alpha) and 0.0 <= alpha <= 1.0,
          f"alpha must be a number in [0, 1], got {alpha!r}")
    check(isinstance(draft_len, int) and not isinstance(draft_len, bool) and draft_len >= 0,
          f"draft_len (K) must be an integer >= 0, got {draft_len!r}")


def expected_tau(alpha: float, draft_len: int) -> float:
    """Expected tokens emitted per draft-verify round when each drafted token is accepted independently with
    probability `alpha`:

        tau = (1 - alpha^(K+1)) / (1 - alpha)        (= K + 1 when alpha == 1)

    The round always yields at least one token (the verifier's correction or bonus token), hence tau >= 1.
    """
    _check_alpha_k(alpha, draft_len)
    if alpha == 1.0:
        # The closed form is 0/0 here; the geometric series 1 + alpha + ... + alpha^K sums to K + 1.
        return float(draft_len + 1)
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, draft_len: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Predicted wall-clock speedup of self-speculative decoding over plain autoregressive decoding.

    Leviathan et al. (2023), Thm 3.8, with the verify pass given its own cost:

        tau     = (1 - alpha^(K+1)) / (1 - alpha)        (K + 1 when alpha == 1)
        cost    = K * draft_cost + verify_cost
        speedup = tau / cost

    Costs are relative to one full-model autoregressive step (= 1.0). `draft_cost` is one draft step (layers
    < E plus the exit head, ~E/L). `verify_cost` is one verify pass over the K+1 positions; with early-layer
    reuse it runs only layers >= E over the K+1 positions plus layers < E over one token, so it is usually
    close to (L - E)/L + E/L = 1 when the pass is memory-bound. With verify_cost = 1 this is the paper's
    formula (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)).
    """
    _check_alpha_k(alpha, draft_len)
    check(_is_number(draft_cost) and math.isfinite(draft_cost) and draft_cost > 0,
          f"draft_cost must be a finite number > 0, got {draft_cost!r}")
    check(_is_number(verify_cost) and math.isfinite(verify_cost) and verify_cost > 0,
          f"verify_cost must be a finite number > 0, got {verify_cost!r}")
    return expected_tau(alpha, draft_len) / (draft_len * draft_cost + verify_cost)


def alpha_from_accept_rate_per_position(rates: Iterable[float | None]) -> float:
    """Estimate one per-token acceptance probability alpha from per-position *conditional* acceptance rates.

    rates[i] is P(draft token i+1 accepted | tokens 1..i accepted). Under the i.i.d. model behind
    `expected_tau` every one of these equals alpha, so the estimator is their unweighted mean, skipping
    None/NaN (positions that were never reached). Equal weights are deliberate: weighting by the number of
    drafts would let position 1, which is always reached, dominate, although later positions usually have lower
    acceptance and matter as much for tau.
    """
    check(rates is not None, "rates must be a list of acceptance rates, got None")
    usable: list[float] = []
    for i, r in enumerate(rates):
        if r is None or (_is_number(r) and math.isnan(r)):
            continue
        check(_is_number(r) and 0.0 <= r <= 1.0,
              f"rates[{i}] must be in [0, 1] or None/NaN, got {r!r}")
        usable.append(float(r))
    check(bool(usable), "rates has no usable value (all None/NaN or empty): cannot estimate alpha")
    return sum(usable) / len(usable)


def cost_ratios(records: list[dict], method: str = "selfspec", baseline: str = "autoregressive") -> dict | None:
    """Measured draft and verify costs of `method`, relative to one step of `baseline`, from engine stats.

        c = (sum draft_s / sum draft_steps) / step,   v = (sum verify_s / sum verify_steps) / step

    where step = the baseline's seconds per verify step (one token per step when it does not draft). The engine
    stats of `method` must carry draft_s / verify_s (ours do; HF's generate does not). draft_steps counts every
    exit-head pass, including drafts declined under a draft_threshold (older stats without it: drafted). Both sides include the
    prefill in their first step, so for long prompts and few new tokens v is biased up; the sweep report shows
    measured next to predicted speedup to make such gaps visible. Returns {"draft_cost", "verify_cost",
    "step_s"} or None when either side is missing or never drafted.
    """
    def sums(name: str, keys: tuple[str, ...]) -> dict[str, float] | None:
        rows = [r["stats"] for r in records if r.get("method") == name]
        if not rows or any(k not in s for s in rows for k in keys):
            return None
        return {k: float(sum(s[k] for s in rows)) for k in keys}

    mine = sums(method, ("draft_s", "verify_s", "drafted", "verify_steps"))
    passes = sums(method, ("draft_steps",))
    if mine and passes:
        mine["drafted"] = passes["draft_steps"]
    base = sums(baseline, ("verify_s", "verify_steps")) or sums(baseline, ("seconds", "verify_steps"))
    if not mine or not base or not mine["drafted"] or not mine["verify_steps"] or not base["verify_steps"]:
        return None
    step = base.get("verify_s", base.get("seconds")) / base["verify_steps"]
    if step <= 0:
        return None
    return {
        "draft_cost": mine["draft_s"] / mine["drafted"] / step,
        "verify_cost": mine["verify_s"] / mine["verify_steps"] / step,
        "step_s": step,
    }


# --------------------------------------------------------------------------------------------------------------
# Per-method summary of per-prompt records
# --------------------------------------------------------------------------------------------------------------

_REQUIRED_STATS = ("new_tokens", "verify_steps", "seconds", "accepted", "drafted")


@dataclass
class _PromptResult:
    """One (method, prompt_id): records of the same key (one per turn of a multi-turn prompt) are merged."""

    category: str
    token_ids: list[int] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)  # each record's counts (_REQUIRED_STATS, per-position lists)
    peak_memory_mb: float | None = None
    draft_bytes: int | None = None  # the draft's low-precision weight copies (stats.draft_bytes)
    head_params: int | None = None
    sampled: bool = False  # decoded at temperature > 0: not compared token for token

    @cached_property
    def stats(self) -> dict:
        """Its turns' counts pooled (decoding/stats.py: pool_stats)."""
        return _pooled(self.turns)


def _pooled(stats: Iterable[dict]) -> dict:
    # The summary's rates are None (printed "-") where nothing was verified, drafted or timed.
    return pool_stats(list(stats), empty=None)


def _validated_counts(values: Any, where: str) -> list[int]:
    check(isinstance(values, (list, tuple)), f"{where} must be a list of integers, got {type(values).__name__}")
    for i, v in enumerate(values):
        check(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
              f"{where}[{i}] must be an integer >= 0, got {v!r}")
    return list(values)


def _collect(records: list[dict]) -> dict[str, dict[str, _PromptResult]]:
    """Validate records and group them as method -> prompt_id -> merged result (insertion order kept)."""
    check(isinstance(records, (list, tuple)), f"records must be a list of dicts, got {type(records).__name__}")
    out: dict[str, dict[str, _PromptResult]] = {}
    for n, rec in enumerate(records):
        where = f"records[{n}]"
        check(isinstance(rec, dict), f"{where} must be a dict, got {type(rec).__name__}")
        for key in ("method", "prompt_id", "token_ids", "stats"):
            check(key in rec, f"{where} is missing '{key}'")
        method, pid = rec["method"], str(rec["prompt_id"])
        check(isinstance(method, str) and method != "", f"{where}.method must be a non-empty string")
        token_ids = _validated_counts(rec["token_ids"], f"{where}.token_ids")
        stats = rec["stats"]
        check(isinstance(stats, dict), f"{where}.stats must be a dict")
        for key in _REQUIRED_STATS:
            check(key in stats, f"{where}.stats is missing '{key}'")
            v = stats[key]
            check(_is_number(v) and math.isfinite(v) and v >= 0,
                  f"{where}.stats.{key} must be a finite number >= 0, got {v!r}")
        check(stats["accepted"] <= stats["drafted"],
              f"{where}.stats.accepted ({stats['accepted']}) exceeds drafted ({stats['drafted']})")
        # Methods that never draft (plain generate) may omit the per-position lists.
        drafted_pp = _validated_counts(stats.get("drafted_per_position") or [], f"{where}.stats.drafted_per_position")
        accepted_pp = _validated_counts(stats.get("accepted_per_position") or [],
                                        f"{where}.stats.accepted_per_position")
        check(len(accepted_pp) <= len(drafted_pp) or not any(accepted_pp[len(drafted_pp):]),
              f"{where}.stats.accepted_per_position is longer than drafted_per_position")
        for i, (a, d) in enumerate(zip(accepted_pp, drafted_pp)):
            check(a <= d, f"{where}.stats: accepted_per_position[{i}]={a} exceeds drafted_per_position[{i}]={d}")
        peak = stats.get("peak_memory_mb")
        check(peak is None or (_is_number(peak) and peak >= 0),
              f"{where}.stats.peak_memory_mb must be a number >= 0 or absent, got {peak!r}")
        draft_bytes = stats.get("draft_bytes")
        check(draft_bytes is None or (isinstance(draft_bytes, int) and draft_bytes >= 0),
              f"{where}.stats.draft_bytes must be an integer >= 0 or absent, got {draft_bytes!r}")
        head_params = rec.get("head_params")
        check(head_params is None or (isinstance(head_params, int) and head_params >= 0),
              f"{where}.head_params must be an integer >= 0 or absent, got {head_params!r}")
        sampled = rec.get("sampled", False)
        check(isinstance(sampled, bool), f"{where}.sampled must be true, false or absent, got {sampled!r}")

        by_prompt = out.setdefault(method, {})
        res = by_prompt.get(pid)
        if res is None:
            res = by_prompt[pid] = _PromptResult(category=str(rec.get("category") or "uncategorized"))
        # A second record with the same key is the next turn of the same conversation: concatenate its ids
        # and add its counts, so a per-turn and a per-conversation dump summarise identically.
        res.token_ids.extend(token_ids)
        res.turns.append({"new_tokens": int(stats["new_tokens"]), "verify_steps": int(stats["verify_steps"]),
                          "seconds": float(stats["seconds"]), "accepted": int(stats["accepted"]),
                          "drafted": int(stats["drafted"]), "drafted_per_position": drafted_pp,
                          "accepted_per_position": accepted_pp})
        if peak is not None:
            res.peak_memory_mb = max(res.peak_memory_mb or 0.0, float(peak))
        if draft_bytes is not None:
            res.draft_bytes = max(res.draft_bytes or 0, draft_bytes)
        if head_params is not None:
            res.head_params = head_params
        res.sampled = res.sampled or sampled
    return out


BOOTSTRAP_RESAMPLES = 2000


def bootstrap_ratio_ci(mine: list[tuple[float, float]], ref: list[tuple[float, float]], level: float = 0.95,
                       resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """A percentile bootstrap interval over prompts for the speedup (total tokens / total seconds of one method
    over the same of the reference). mine[i], ref[i]: (tokens, seconds) of prompt i. Prompts are resampled with
    replacement, both methods' prompt i together, so the interval reflects how much the ratio depends on which
    prompts were drawn; it does not cover the machine's drift between runs. None with fewer than 2 prompts."""
    import numpy as np

    if len(mine) < 2 or len(mine) != len(ref):
        return None
    a, b = np.asarray(mine, dtype=np.float64), np.asarray(ref, dtype=np.float64)  # (P, 2) each
    idx = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))  # (R, P)
    sa, sb = a[idx].sum(axis=1), b[idx].sum(axis=1)  # (R, 2): summed tokens and seconds per resample
    ok = (sa[:, 1] > 0) & (sb[:, 0] > 0)
    if not ok.any():
        return None
    ratio = (sa[ok, 0] / sa[ok, 1]) / (sb[ok, 0] / sb[ok, 1])
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(ratio, [tail, 100 - tail])
    return float(lo), float(hi)


def _tokens_seconds(r: _PromptResult) -> tuple[float, float]:
    s = r.stats
    return float(s["new_tokens"]), float(s["seconds"])


def _metrics(mine: dict[str, _PromptResult], pids: list[str],
             ref: dict[str, _PromptResult] | None) -> dict[str, Any]:
    """Core numbers of one method over the prompt ids `pids` (all in `mine`), pooled over those prompts."""
    pooled = _pooled(mine[p].stats for p in pids)
    speedup = lossless = ci = None
    if ref is not None:
        # Speed and identity are compared only on prompts both methods ran, so a partial run of either side
        # does not skew the ratio with prompts of different length.
        shared = [p for p in pids if p in ref]
        if shared:
            # Total tokens over total time (not a mean of per-prompt rates) so long prompts weigh by their time.
            mine_tps = _pooled(mine[p].stats for p in shared)["tokens_per_s"]
            ref_tps = _pooled(ref[p].stats for p in shared)["tokens_per_s"]
            if mine_tps is not None and ref_tps:
                speedup = mine_tps / ref_tps
                ci = None if mine is ref else bootstrap_ratio_ci([_tokens_seconds(mine[p]) for p in shared],
                                        [_tokens_seconds(ref[p]) for p in shared])
            # Two exact samplers draw different tokens from the same distribution: sampled outputs are not compared.
            if not any(mine[p].sampled or ref[p].sampled for p in shared):
                lossless = sum(mine[p].token_ids == ref[p].token_ids for p in shared) / len(shared)
    return {
        "tokens_per_s": pooled["tokens_per_s"],
        "speedup": speedup,
        "speedup_ci95": list(ci) if ci else None,
        "tau": pooled["tau"],
        "accept_rate": pooled["accept_rate"],
        "lossless": lossless,
        "accept_rate_per_position": pooled["accept_rate_per_position"],
        "new_tokens": pooled["new_tokens"],
    }


def summarize_methods(records: list[dict], reference: str = "hf_generate") -> dict:
    """Aggregate per-prompt decode records into per-method and per-category numbers.

    Each record is `{"method", "prompt_id", "category", "token_ids", "stats": {"new_tokens", "verify_steps",
    "seconds", "accepted", "drafted", "accept_rate_per_position", "drafted_per_position",
    "accepted_per_position", "peak_memory_mb"?}, "head_params"?}`. Records are keyed by (method, prompt_id);
    several records with one key (turns of a multi-turn prompt) are merged by concatenating token_ids and
    summing the counts.

    Returns `{"reference": reference, "methods": {name: {...}}, "per_category": {category: {name: {...}}}}`:

    - tokens_per_s: total new tokens / total seconds.
    - speedup: tokens_per_s / the reference's tokens_per_s, both over the prompts the two share (None when the
      reference method is absent).
    - tau: total new tokens / total verify steps (tokens per forward pass of the full model).
    - accept_rate: total accepted / total drafted (None when nothing was drafted).
    - accept_rate_per_position: summed accepted / summed drafted at each draft position (None where nothing
      was drafted); recomputed from the counts rather than averaging per-prompt rates.
    - lossless: fraction of shared prompts whose token_ids equal the reference's (None without reference, and
      None when either side sampled: records with "sampled": true are not compared token for token).
    - sampled: whether the method decoded at temperature > 0 (its lossless is then not checked here; sampling's
      exactness is the distribution tests' job). The summary's top-level "sampled" says whether any method did.
    - peak_memory_mb: max over prompts (None when no record reports it); draft_memory_mb: the draft's
      low-precision weight copies (stats.draft_bytes, in MB; 0 at full precision, None when not reported);
      head_params: as reported, else None.
    - prompts, new_tokens: number of distinct prompt ids and total new tokens.
    """
    grouped = _collect(records)
    ref = grouped.get(reference)

    methods: dict[str, dict[str, Any]] = {}
    per_category: dict[str, dict[str, dict[str, Any]]] = {}
    for name, mine in grouped.items():
        methods[name] = _method_summary(mine, ref)
        categories: dict[str, list[str]] = {}
        for pid, r in mine.items():
            categories.setdefault(r.category, []).append(pid)
        for cat, cat_pids in categories.items():
            cm = _metrics(mine, cat_pids, ref)
            per_category.setdefault(cat, {})[name] = {k: cm[k] for k in
                                                     ("tokens_per_s", "speedup", "tau", "accept_rate", "lossless")}

    return {"reference": reference, "methods": methods, "per_category": per_category,
            "sampled": any(m["sampled"] for m in methods.values())}


def _method_summary(mine: dict, ref: dict | None) -> dict[str, Any]:
    """One method's numbers over all its prompts (see summarize_methods); `mine`: its merged records by prompt id."""
    pids = list(mine)
    m = _metrics(mine, pids, ref)
    peaks = [r.peak_memory_mb for r in mine.values() if r.peak_memory_mb is not None]
    head_params = next((r.head_params for r in mine.values() if r.head_params is not None), None)
    drafts = [r.draft_bytes for r in mine.values() if r.draft_bytes is not None]
    return {
        "tokens_per_s": m["tokens_per_s"],
        "speedup": m["speedup"],
        "speedup_ci95": m["speedup_ci95"],
        "tau": m["tau"],
        "accept_rate": m["accept_rate"],
        "accept_rate_per_position": m["accept_rate_per_position"],
        "lossless": m["lossless"],
        "sampled": any(r.sampled for r in mine.values()),
        "peak_memory_mb": max(peaks) if peaks else None,
        "draft_memory_mb": max(drafts) / 1e6 if drafts else None,
        "head_params": head_params,
        "prompts": len(pids),
        "new_tokens": m["new_tokens"],
    }


# --------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:{spec}}{suffix}"


def _ci(ci) -> str:
    return "-" if not ci else f"{ci[0]:.2f}-{ci[1]:.2f}x"


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100.0 * x:.1f}%"


def _count(n: int | None) -> str:
    # Head sizes span 10^4..10^9; a compact form keeps the column readable.
    if n is None:
        return "-"
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    # The first column names the row (left), the others are numbers (right).
    return table(header, rows, align or [LEFT] + [RIGHT] * (len(header) - 1))


def summary_markdown(summary: dict) -> str:
    """Markdown for a `summarize_methods` result: a methods table, per-category speedups and acceptance by draft
    position. Missing values print as "-"."""
    check(isinstance(summary, dict) and isinstance(summary.get("methods"), dict),
          "summary must be the dict returned by summarize_methods (with a 'methods' dict)")
    methods: dict[str, dict] = summary["methods"]
    reference = summary.get("reference")
    lines = ["# Evaluation summary", ""]
    if reference:
        present = reference in methods
        lines += [f"Reference: `{reference}`" + ("" if present else " (absent: no speedup or lossless numbers)"), ""]

    lines += ["## Methods", ""]
    ref_sampled = bool((methods.get(reference) or {}).get("sampled"))
    rows = [[f"`{name}`", _fmt(m.get("tokens_per_s"), ".1f"), _fmt(m.get("speedup"), ".2f", "x"),
             _ci(m.get("speedup_ci95")),
             _fmt(m.get("tau"), ".2f"), _pct(m.get("accept_rate")),
             "n/a (sampled)" if m.get("sampled") or ref_sampled else _pct(m.get("lossless")),
             _fmt(m.get("peak_memory_mb"), ".0f"), _fmt(m.get("draft_memory_mb"), ".0f"), _count(m.get("head_params"))]
            for name, m in methods.items()]
    lines += _table(["method", "tokens/s", "speedup", "95% interval", "tau", "accept rate", "lossless", "peak MB",
                     "draft MB", "head params"], rows)
    if any(m.get("speedup_ci95") for m in methods.values()):
        lines += ["", "The 95% interval is a bootstrap over prompts (which prompts were drawn); the machine's drift "
                  "between runs is not in it."]
    if summary.get("sampled") or any(m.get("sampled") for m in methods.values()):
        lines += ["", "Sampled (temperature > 0): lossless is not checked token for token here, since two exact "
                  "samplers draw different tokens from the same distribution; that speculative sampling keeps the "
                  f"target's distribution is checked by the distribution tests ({SAMPLING_TESTS}). Speedup, tau and "
                  "acceptance are measured as usual, each prompt's turn sampled with the same seed by every method."]

    per_category: dict[str, dict[str, dict]] = summary.get("per_category") or {}
    if per_category:
        names = list(methods)
        lines += ["", "## Speedup by category", ""]
        rows = [[cat] + [_fmt((per_category[cat].get(n) or {}).get("speedup"), ".2f", "x") for n in names]
                for cat in sorted(per_category)]
        lines += _table(["category"] + [f"`{n}`" for n in names], rows)

    drafting = {n: m["accept_rate_per_position"] for n, m in methods.items() if m.get("accept_rate_per_position")}
    if drafting:
        k_max = max(len(v) for v in drafting.values())
        lines += ["", "## Acceptance by draft position", "",
                  "Accepted at position k / drafted at position k: the share of verify steps whose k-th draft was "
                  "accepted, which needs drafts 1..k-1 accepted too (not conditional on them). With every step "
                  "drafting K, the rates sum to tau - 1.", ""]
        rows = [[f"`{n}`"] + [_pct(v[k] if k < len(v) else None) for k in range(k_max)]
                for n, v in drafting.items()]
        lines += _table(["method"] + [str(k + 1) for k in range(k_max)], rows)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------
# (E, K) sweeps
# --------------------------------------------------------------------------------------------------------------

_GRID_KEYS = ("speedup", "predicted_speedup", "tau", "accept_rate")


def _validate_sweep_rows(rows: list[dict]) -> None:
    check(isinstance(rows, (list, tuple)) and len(rows) > 0, "sweep rows must be a non-empty list of dicts")
    for n, row in enumerate(rows):
        check(isinstance(row, dict), f"rows[{n}] must be a dict, got {type(row).__name__}")
        for key in ("exit_layer", "draft_len"):
            v = row.get(key)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                  f"rows[{n}].{key} must be an integer >= 0, got {v!r}")
        for key in _GRID_KEYS:
            v = row.get(key)
            # None marks a failed or not-yet-finished job; it is reported as "-" rather than rejected.
            check(v is None or (_is_number(v) and not math.isnan(v)),
                  f"rows[{n}].{key} must be a number or None, got {v!r}")


def _speed_key(row: dict) -> float:
    # Sorting key: rows without a measured speedup go last.
    s = row.get("speedup")
    return -math.inf if s is None else float(s)


def sweep_grid(rows: list[dict]) -> dict:
    """2-D grids over exit layer E (rows) x draft length K (columns).

    Returns `{"exit_layers": [E...], "draft_lens": [K...], "speedup": [[...]], "predicted_speedup": [[...]],
    "tau": [[...]], "accept_rate": [[...]], "head": [[...]]}` with `grid[key][i][j]` the value at
    (exit_layers[i], draft_lens[j]), None for combinations the sweep did not run. When several rows share an
    (E, K) (different heads), the cell holds the one with the best measured speedup.
    """
    _validate_sweep_rows(rows)
    exit_layers = sorted({r["exit_layer"] for r in rows})
    draft_lens = sorted({r["draft_len"] for r in rows})
    best: dict[tuple[int, int], dict] = {}
    for r in rows:
        key = (r["exit_layer"], r["draft_len"])
        if key not in best or _speed_key(r) > _speed_key(best[key]):
            best[key] = r
    grid: dict[str, Any] = {"exit_layers": exit_layers, "draft_lens": draft_lens}
    for key in _GRID_KEYS + ("head",):
        grid[key] = [[(best.get((e, k)) or {}).get(key) for k in draft_lens] for e in exit_layers]
    return grid


def aggregate_sweep(rows: list[dict]) -> tuple[str, dict]:
    """Markdown report (`sweep.md`) and E x K grids (see `sweep_grid`) for one row per sweep job
    `{"exit_layer", "draft_len", "head", "tau", "accept_rate", "speedup", "predicted_speedup"}`.

    The table is sorted by measured speedup, best first, and shows measured next to predicted speedup; a line
    above it names the best (E, K).
    """
    grid = sweep_grid(rows)
    ordered = sorted(rows, key=_speed_key, reverse=True)
    lines = ["# Exit-layer x draft-length sweep", ""]
    top = ordered[0]
    if top.get("speedup") is None:
        lines += ["No job reported a measured speedup.", ""]
    else:
        pred = top.get("predicted_speedup")
        prec = top.get("draft_precision") or "full"
        lines += [f"**Best: E={top['exit_layer']}, K={top['draft_len']}"
                  + (f", {prec}" if prec != "full" else "") + f"** (head `{top.get('head') or '-'}`): "
                  f"measured speedup {top['speedup']:.2f}x"
                  + (f", predicted {pred:.2f}x" if pred is not None else "")
                  + (f", tau {top['tau']:.2f}" if top.get("tau") is not None else "") + ".", ""]

    table_rows = []
    for r in ordered:
        meas, pred = r.get("speedup"), r.get("predicted_speedup")
        # measured / predicted shows at a glance where the cost model is off (e.g. verify slower than assumed).
        ratio = meas / pred if meas is not None and pred else None
        table_rows.append([str(r["exit_layer"]), str(r["draft_len"]), r.get("draft_precision") or "full",
                           f"`{r.get('head') or '-'}`", _fmt(meas, ".2f", "x"), _fmt(pred, ".2f", "x"),
                           _fmt(ratio, ".2f"), _fmt(r.get("tau"), ".2f"), _pct(r.get("accept_rate"))])
    lines += _table(["E", "K", "precision", "head", "speedup", "predicted", "measured/predicted", "tau", "accept rate"],
                    table_rows, align=[RIGHT, RIGHT, LEFT, LEFT] + [RIGHT] * 5)
    return "\n".join(lines) + "\n", grid
