"""Sample inputs shared by the report and plot tests: per-prompt records and sweep rows."""

from selfspec.evaluation.report import expected_tau, predicted_speedup

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
    # Atomic write: no temp file left next to the target.
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def rec(method, pid, cat, ids, new, steps, secs, acc=0, drafted=0, dpp=(), app=(), peak=None, head_params=None):
    stats = {"new_tokens": new, "verify_steps": steps, "seconds": secs, "accepted": acc, "drafted": drafted,
             "accept_rate_per_position": [a / d if d else None for a, d in zip(app, dpp)],
             "drafted_per_position": list(dpp), "accepted_per_position": list(app)}
    if peak is not None:
        stats["peak_memory_mb"] = peak
    out = {"method": method, "prompt_id": pid, "category": cat, "token_ids": list(ids), "stats": stats}
    if head_params is not None:
        out["head_params"] = head_params
    return out


def records():
    ids1, ids2 = list(range(10)), list(range(100, 120))
    return [
        rec("hf_generate", "p1", "code", ids1, 10, 10, 1.0, peak=1000.0),
        rec("hf_generate", "p2", "chat", ids2, 20, 20, 2.0, peak=1100.0),
        rec("selfspec", "p1", "code", ids1, 10, 4, 0.5, 6, 9, [4, 3, 2], [3, 2, 1], peak=1200.0,
             head_params=2_500_000),
        # p2 differs in its last token: not lossless there.
        rec("selfspec", "p2", "chat", ids2[:-1] + [7], 20, 6, 0.5, 14, 18, [6, 6, 6], [6, 5, 3], peak=1250.0,
             head_params=2_500_000),
    ]


def sweep_rows():
    rows = []
    for e in (4, 8, 12):
        for k in (2, 4, 6):
            alpha = 0.3 + 0.04 * e
            pred = predicted_speedup(alpha, k, e / 24)
            # Measured a bit below predicted; (8, 4) is made the best below.
            rows.append({"exit_layer": e, "draft_len": k, "head": "linear", "tau": expected_tau(alpha, k),
                         "accept_rate": alpha, "speedup": 0.9 * pred, "predicted_speedup": pred})
    best = next(r for r in rows if (r["exit_layer"], r["draft_len"]) == (8, 4))
    best["speedup"] = 2.5
    return rows
