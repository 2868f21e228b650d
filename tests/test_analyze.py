"""python -m selfspec.analyze: teacher-forced scoring of exit heads on tiny random models.

The key check: the teacher-forced events, replayed through the engine's greedy schedule, give exactly the
engine's own counts (verify steps, drafted and accepted per position) for K = 1..4, every head kind, dynamic
K too, so the instrument and a real decode count the same events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, randomize_head
from selfspec.analysis import AnalysisConfig, parse_heads, replay, replay_all, score_heads, summarize
from selfspec.analysis.answers import generate_answers, load_or_generate
from selfspec.analysis.heads import HeadEntry, build, changes_model, check_exit_layers, spec_kind, split_lora
from selfspec.analysis.metrics import conditional_agreement, end_to_end, expected_tau, replay_lookup_first
from selfspec.analysis.scoring import PositionScores, _chunk_scores
from selfspec.data import builtin_prompts
from selfspec.decoding.engine import DecodeConfig, Decoder
from selfspec.errors import SelfSpecError
from selfspec.evaluation.runner import Renderer
from selfspec.heads import build_head, make_head_config

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 24
TOPK = [1, 2, 4, 8]


# ------------------------------------------------------------------------------------------------ fixtures
def _answers(model, n_prompts: int = 3, eos_ids=None):
    items = builtin_prompts(limit=n_prompts)
    return generate_answers(model.backbone, Renderer(model.tokenizer, False), items, MAX_NEW,
                            model.eos_ids if eos_ids is None else eos_ids, overhang=8)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


@pytest.fixture(scope="module")
def eos(tiny):
    """A token the tiny model writes mid-answer, used as EOS: answers then end early, and the replay must
    count what the engine verifies past the EOS (the overhang)."""
    first = _answers(tiny, 1, eos_ids=[])[0]
    return [first.answer_ids[5]]


@pytest.fixture(scope="module")
def seqs(tiny, eos):
    out = _answers(tiny, 3, eos)
    assert any(s.overhang_ids for s in out) and any(not s.overhang_ids for s in out), "want both endings"
    return out


@pytest.fixture(scope="module")
def heads(tiny):
    bb = tiny.backbone
    out = {"lens@2": build_head(make_head_config("lens", exit_layer=2), bb),
           "lens@4": build_head(make_head_config("lens", exit_layer=4), bb),
           "medusa@3": build_head(make_head_config("medusa", exit_layer=3), bb),
           "adapter@3": build_head(make_head_config("adapter", exit_layer=3), bb),
           "vocab@4": build_head(make_head_config("medusa", exit_layer=4, draft_vocab=200), bb, [257])}
    for i, name in enumerate(("medusa@3", "adapter@3", "vocab@4")):
        randomize_head(out[name], seed=i, std=0.05)
    return out


@pytest.fixture(scope="module")
def scores(tiny, heads, seqs):
    sc, mismatch = score_heads(tiny.backbone, heads, seqs, TOPK, chunk=7)  # a small chunk: chunk seams tested
    assert mismatch == 0
    return sc


def _decode_counts(model, head, seqs, eos, K: int, threshold=None, tokens_per_pass: int = 1, draft_continue=None) -> dict:
    dec = Decoder(model.backbone, head)
    cfg = DecodeConfig(draft_len=K, max_new_tokens=MAX_NEW, draft_threshold=threshold, tokens_per_pass=tokens_per_pass,
                       draft_continue=draft_continue)
    tot = {"new_tokens": 0, "verify_steps": 0, "draft_steps": 0, "accepted_per_position": [0] * K,
           "drafted_per_position": [0] * K}
    for s in seqs:
        new, st = dec.generate(s.prompt_ids, cfg, eos)
        assert new == s.answer_ids  # lossless: the answers are the target's
        for key in ("new_tokens", "verify_steps", "draft_steps"):
            tot[key] += st[key]
        for key in ("accepted_per_position", "drafted_per_position"):
            tot[key] = [a + b for a, b in zip(tot[key], st[key])]
    return tot


# ------------------------------------------------------------------------------------------------ the key check
@pytest.mark.parametrize("name", ["lens@2", "lens@4", "medusa@3", "adapter@3", "vocab@4"])
def test_replay_equals_engine_counts(tiny, heads, seqs, scores, eos, name):
    for K in (1, 2, 3, 4):
        got = replay_all(scores[name], MAX_NEW, K)
        want = _decode_counts(tiny, heads[name], seqs, eos, K)
        assert got["verify_steps"] == want["verify_steps"], (name, K)
        assert got["accepted_per_position"] == want["accepted_per_position"], (name, K)
        assert got["drafted_per_position"] == want["drafted_per_position"], (name, K)
        if K == 1:  # K=1: teacher-forced agreement on the drafted positions is the decode's accept rate
            assert got["accept_rate"] == pytest.approx(want["accepted_per_position"][0] / want["drafted_per_position"][0])


@pytest.mark.parametrize("name", ["lens@4", "medusa@3"])
def test_lookup_first_replay_equals_engine_counts(tiny, heads, seqs, scores, eos, name):
    """decode.lookup_mode=first: lookup's chain where the history matches, the head's drafts elsewhere; replayed on
    the answers, the rounds of each kind and their accepted tokens are the engine's."""
    settings = {"len": 3, "min_ngram": 1, "max_ngram": 3}  # single-token matches: lookup rounds on tiny answers
    for K in (2, 4):
        cfg = DecodeConfig(draft_len=K, max_new_tokens=MAX_NEW, lookup=True, lookup_mode="first", lookup_len=3,
                           lookup_min_ngram=1, lookup_max_ngram=3)
        dec = Decoder(tiny.backbone, heads[name])
        want = {"verify_steps": 0, "draft_steps": 0, "drafted_lookup": 0, "accepted_lookup": 0, "accepted": 0}
        got = {"rounds": 0, "passes": 0, "lookup_drafted": 0, "lookup_accepted": 0, "accepted": 0, "head_rounds": 0}
        for s, sc in zip(seqs, scores[name]):
            new, st = dec.generate(s.prompt_ids, cfg, eos)
            assert new == s.answer_ids
            for key in want:
                want[key] += st[key]
            r = replay_lookup_first(sc.correct.tolist(), s.prompt_ids, s.answer_ids + s.overhang_ids, sc.n_answer,
                                    MAX_NEW, K, settings)
            got["rounds"] += sum(r["rounds"].values())
            got["head_rounds"] += r["rounds"].get("head", 0)
            got["passes"] += r["passes"]
            got["lookup_drafted"] += r["drafted"].get("lookup", 0)
            got["lookup_accepted"] += r["accepted"].get("lookup", 0)
            got["accepted"] += sum(r["accepted"].values())
        assert got["rounds"] == want["verify_steps"] and got["passes"] == want["draft_steps"], (name, K, got, want)
        assert (got["lookup_drafted"], got["lookup_accepted"]) == (want["drafted_lookup"], want["accepted_lookup"])
        assert got["accepted"] == want["accepted"]
        assert got["lookup_drafted"] > 0 and got["head_rounds"] > 0  # both kinds of round were replayed


def test_replay_counts_are_not_trivial(scores):
    """The equality above must be able to fail: some chains of accepted drafts, and some rejections."""
    r = replay_all(scores["lens@4"], MAX_NEW, 4)
    assert r["accepted_per_position"][1] > 0 and r["accepted"] < r["drafted"]


def test_replay_dynamic_k_equals_engine(tiny, heads, seqs, scores, eos):
    for name in ("lens@4", "medusa@3"):
        want = _decode_counts(tiny, heads[name], seqs, eos, 4, threshold=0.3)
        got = replay_all(scores[name], MAX_NEW, 4, threshold=0.3)
        assert got["verify_steps"] == want["verify_steps"]
        assert got["accepted_per_position"] == want["accepted_per_position"]
        assert all(g <= w for g, w in zip(got["drafted_per_position"], want["drafted_per_position"]))


def test_replay_joint_confidence_k_equals_engine(tiny, heads, seqs, scores, eos):
    """decode.draft_continue replayed: the engine's rounds and accepted drafts event for event; drafted is a lower
    bound (a round goes on drafting past a wrong draft the replay stops at). Rounds of every length occur."""
    for name in ("lens@4", "medusa@3"):
        want = _decode_counts(tiny, heads[name], seqs, eos, 4, draft_continue=0.05)
        got = replay_all(scores[name], MAX_NEW, 4, draft_continue=0.05)
        assert got["verify_steps"] == want["verify_steps"], name
        assert got["accepted_per_position"] == want["accepted_per_position"], name
        assert all(g <= w for g, w in zip(got["drafted_per_position"], want["drafted_per_position"])), name
        assert want["drafted_per_position"][0] > want["drafted_per_position"][1] > 0, name  # some rounds stop, some go on
    s = summarize(scores["lens@4"], TOPK, [1, 4], MAX_NEW, draft_continue=0.3)
    assert s["replay_continue"]["threshold"] == 0.3
    assert s["replay_continue"]["by_k"][4]["tau"] == replay_all(scores["lens@4"], MAX_NEW, 4, draft_continue=0.3)["tau"]
    assert s["replay_continue"]["by_k"][1]["tau"] == s["replay"][1]["tau"]  # K=1: the first draft is always made


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_parallel_drafts_replay_equals_engine(tiny, seqs, eos, arch):
    """decode.tokens_per_pass=m: the replay over each start's own events (draft j from head j mod m of the pass at
    t + j - j mod m) gives the engine's counts, event for event, and its passes are the engine's draft passes. The
    tiny gemma3 answers in loops of one token, where the extra heads (near the lens) are often right."""
    if arch != "llama":
        tiny = make_tiny(arch)
        seqs = _answers(tiny, 2, eos_ids=[])
        eos = []
    head = build_head(make_head_config("medusa", exit_layer=4, num_heads=3), tiny.backbone)
    randomize_head(head, seed=7, std=0.02)
    sc, _ = score_heads(tiny.backbone, {"m": head}, seqs, TOPK, chunk=7)
    assert sc["m"][0].ahead_correct.shape == (sc["m"][0].correct.numel(), 2)
    extra_accepted = 0
    for m, K in ((2, 2), (2, 4), (3, 3), (3, 5)):
        got = replay_all(sc["m"], MAX_NEW, K, per_pass=m)
        want = _decode_counts(tiny, head, seqs, eos, K, tokens_per_pass=m)
        assert got["verify_steps"] == want["verify_steps"], (m, K)
        assert got["accepted_per_position"] == want["accepted_per_position"], (m, K)
        assert got["drafted_per_position"] == want["drafted_per_position"], (m, K)
        assert got["passes"] == want["draft_steps"], (m, K)
        extra_accepted += got["accepted_per_position"][1]  # draft 2 always comes from an extra head here
        summary = summarize(sc["m"], TOPK, [K], MAX_NEW, per_pass=m)
        assert summary["tokens_per_pass"] == m and len(summary["ahead_agreement"]) == m - 1
        assert 1.0 <= summary["tau"][K] <= K + 1
    if arch != "llama":
        assert extra_accepted > 0  # the events of extra heads are exercised, not only rejected
    with pytest.raises(ValueError, match="per_pass=4"):
        replay_all(sc["m"], MAX_NEW, 4, per_pass=4)


@pytest.mark.parametrize("E, source", [(0, "final"), (4, "final"), (0, "fused"), (4, "fused")])
def test_context_head_replay_equals_engine(tiny, seqs, eos, E, source):
    """head=context: drafts 2.. of a round read the head's own predicted features, so its events are per start
    (chained_correct, from training-time test's steps); replayed, they give the engine's counts event for event,
    and at E=4 some drafts past the first are accepted. source=fused: the analysis captures the states at the
    head's depths in its one pass, as verification does."""
    head = build_head(make_head_config("context", exit_layer=E, context_source=source), tiny.backbone)
    assert len(head.context_depths) == (1 if source == "final" else 2 if E == 4 else 3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # near the lens it starts as, so that drafts are often right, but not the lens
        for p in head.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    sc, _ = score_heads(tiny.backbone, {"c": head}, seqs, TOPK, chunk=7)
    first = sc["c"][0]
    assert first.chained_correct.shape == (first.correct.numel(), 8)
    assert torch.equal(first.chained_correct[:, 0], first.correct)
    later = 0
    for K in (1, 2, 4):
        got = replay_all(sc["c"], MAX_NEW, K)
        want = _decode_counts(tiny, head, seqs, eos, K)
        assert got["verify_steps"] == want["verify_steps"], K
        assert got["accepted_per_position"] == want["accepted_per_position"], K
        assert got["drafted_per_position"] == want["drafted_per_position"], K
        later += sum(got["accepted_per_position"][1:])
    assert later > 0 or E == 0  # at E=4 the chained events are exercised, not only rejected
    got = replay_all(sc["c"], MAX_NEW, 4, draft_continue=0.2)  # the chained drafts' own probabilities decide
    want = _decode_counts(tiny, head, seqs, eos, 4, draft_continue=0.2)
    assert got["verify_steps"] == want["verify_steps"] and got["accepted_per_position"] == want["accepted_per_position"]
    summary = summarize(sc["c"], TOPK, [4], MAX_NEW)
    assert summary["tau"][4] == pytest.approx(expected_tau(conditional_agreement(sc["c"], 4), 4))


def test_lora_head_replay_equals_engine(eos):
    model = make_tiny("llama")  # a LoRA is injected into the model: not the shared one
    head = build_head(make_head_config("lora", exit_layer=3, lora_rank=4), model.backbone)
    randomize_head(head, seed=3, std=0.05)
    seqs = _answers(model, 2, eos)
    sc, _ = score_heads(model.backbone, {"lora": head}, seqs, TOPK)
    for K in (1, 3):
        got = replay_all(sc["lora"], MAX_NEW, K)
        want = _decode_counts(model, head, seqs, eos, K)
        assert (got["verify_steps"], got["accepted_per_position"]) == (want["verify_steps"], want["accepted_per_position"])


def test_compare_predicted_with_measured_tau(tiny, heads, seqs, scores, eos):
    """analysis.json next to an evaluation's summary.json: the replayed tau is the measured one."""
    from selfspec.analysis.compare import compare

    want = _decode_counts(tiny, heads["lens@4"], seqs, eos, 2)
    measured = want["new_tokens"] / want["verify_steps"]
    overall = summarize(scores["lens@4"], TOPK, [1, 2], MAX_NEW)
    analysis = json.loads(json.dumps({"heads": {"lens@4": {"overall": overall, "per_category": {}}}}))  # int keys -> str
    summary = {"run": {"draft_len": 2, "draft_threshold": None}, "methods": {"selfspec": {"tau": measured}}}
    row = [line for line in compare(analysis, summary).splitlines() if line.startswith("| all |")][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == cells[4] == f"{measured:.2f}" and cells[6] == "1.000"
    with pytest.raises(SelfSpecError, match="--head='x': not in the analysis"):
        compare(analysis, summary, head="x")


# ------------------------------------------------------------------------------------------------ numbers in range
def test_summary_numbers_in_range(scores):
    for name, sc in scores.items():
        s = summarize(sc, TOPK, list(range(1, 9)), MAX_NEW, threshold=0.3)
        assert 0.0 <= s["agreement"] <= 1.0 and s["coverage"][1] == pytest.approx(s["agreement"])
        cov = [s["coverage"][k] for k in TOPK]
        assert all(0.0 <= c <= 1.0 for c in cov) and cov == sorted(cov) and cov[-1] > cov[0]
        assert s["kl"] >= 0.0 and torch.isfinite(torch.tensor(s["kl"]))
        assert all(a is None or 0.0 <= a <= 1.0 for a in s["conditional"]) and s["conditional"][0] == pytest.approx(s["agreement"])
        taus = [s["tau"][k] for k in range(1, 9)]
        assert taus == sorted(taus) and all(1.0 <= t <= k + 1 for k, t in zip(range(1, 9), taus))
        assert all(1.0 <= s["replay"][k]["tau"] <= k + 1 for k in range(1, 9))
        assert 0.0 <= s["outside"] <= 1.0 and (s["outside"] > 0) == (name == "vocab@4")
        assert s["tokens"] == sum(x.n_answer for x in sc)


def test_end_to_end_speedup_counts_the_prefill_for_both_paths():
    """Whole generations: prefill 2 s, 100 tokens at 0.1 s autoregressive; decoding 2x faster makes 12 s into 7 s."""
    pred = {"speedup_replay": {1: 2.0, 2: 4.0, 3: None}}
    e2e = end_to_end(pred, tokens=100, prefill_s=2.0, ar_step_s=0.1)
    assert e2e[1] == pytest.approx(12.0 / 7.0) and e2e[2] == pytest.approx(12.0 / 4.5) and e2e[3] is None
    assert end_to_end(pred, 100, 0.0, 0.1)[2] == pytest.approx(4.0)  # no prefill: the decode speedup itself


def test_conditional_agreement_and_tau_definitions():
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (30, 17, 1):
        c = torch.rand(n + 3, generator=g) < 0.6
        seqs.append(PositionScores(n, c, c[:, None], torch.zeros(n + 3), torch.ones(n + 3), torch.zeros(n + 3)))
    cond = conditional_agreement(seqs, 4)
    for j in range(4):  # brute force: starts t with t+j inside the answer (the overhang is not answer)
        num = den = 0
        for s in seqs:
            c = s.correct[: s.n_answer].tolist()
            for t in range(len(c) - j):
                if all(c[t:t + j]):
                    den += 1
                    num += c[t + j]
        assert cond[j] == pytest.approx(num / den)
    assert expected_tau([0.5] * 4, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tau([0.5, None], 2) == pytest.approx(1.5)


def test_replay_schedule_by_hand():
    # K=2: drafts 0,1 right + bonus -> n=3; draft 3 wrong -> n=4; 4 right, 5 wrong -> n=6; 6,7 right -> done
    c = [1, 1, 0, 0, 1, 0, 1, 1]
    r = replay(c, 8, 100, 2)
    assert r["verify_steps"] == 4 and r["accepted_per_position"] == [3, 2] and r["drafted_per_position"] == [4, 4]
    # draft_continue 0.5: round 1 stops after its second right draft (0.9 x 0.5 < 0.5); round 2 drafts on past 0.9
    r = replay([1, 1, 1, 1], 4, 100, 3, conf=[0.9, 0.5, 0.9, 0.9], draft_continue=0.5)
    assert r["verify_steps"] == 2 and r["accepted_per_position"] == [2, 1, 0] and r["drafted_per_position"] == [2, 2, 0]
    # max_new_tokens caps the last rounds' drafts: at n = max_new - 1 nothing is drafted
    r = replay([1] * 8, 5, 5, 4)
    assert r["verify_steps"] == 1 and r["drafted_per_position"] == [1, 1, 1, 1]


def test_kl_and_draft_vocabulary_scores():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    y = logits.argmax(-1)
    correct, covered, kl, conf, outside = _chunk_scores(logits, logits, y, None, [1, 2])
    assert correct.all() and covered.all() and kl.abs().max() < 1e-5 and (outside == 0).all()
    vocab = torch.arange(10)  # the target's mass outside the draft vocabulary is reported, KL stays finite
    correct, covered, kl, conf, outside = _chunk_scores(logits, logits[:, :10], y, vocab, [1, 2])
    mass_out = 1 - logits.softmax(-1)[:, :10].sum(-1)
    assert torch.allclose(outside, mass_out, atol=1e-6) and torch.isfinite(kl).all() and (kl > 0).all()
    assert (correct == (y < 10)).all() and (conf <= 1).all()


# ------------------------------------------------------------------------------------------------ heads= and the cache
@pytest.mark.parametrize("entry, message", [
    ("bogus", "heads: 'bogus': neither TYPE"),
    ("lens@x", "heads: 'lens@x': the exit layer after '@' must be"),
    ("foo@3", "heads: 'foo@3': unknown head type 'foo'"),
    ("lens@5-2", "heads: 'lens@5-2': empty range"),
])
def test_bad_head_entries(entry, message):
    with pytest.raises(SelfSpecError, match="^" + message.replace("(", r"\(")):
        parse_heads([entry])


def test_head_entries_expand_and_check(tiny, tmp_path):
    specs = parse_heads(["lens", "lens@1-3", "medusa@2"])
    assert [s.entry for s in specs] == ["lens", "lens@1", "lens@2", "lens@3", "medusa@2"]
    with pytest.raises(SelfSpecError, match="given twice"):
        parse_heads(["lens@2", "lens@1-2"])
    with pytest.raises(SelfSpecError, match=r"^heads: 'lens@9': exit layer 9 out of range; allowed 1\.\.6"):
        check_exit_layers(parse_heads(["lens@9"]), tiny.backbone.num_layers)
    with pytest.raises(SelfSpecError, match="at most one head that changes the model"):
        split_lora(parse_heads(["lora@1", "lora@2"]))
    (tmp_path / "nohead").mkdir()
    with pytest.raises(SelfSpecError, match=r"^heads: '.*nohead': .*not a head directory"):
        build(parse_heads([str(tmp_path / "nohead")])[0], tiny)
    # `default`: the shipped head of the loaded model; the tiny model has none, so it is refused by name
    (default,) = parse_heads(["default"])
    # its type before the model is known: the shipped heads' shared type (both ship an int8 lens at the last layer),
    # else "default"; neither changes the model
    from selfspec.heads.saving import default_shipped_heads

    kinds = {json.loads((d / "head_config.json").read_text())["type"] for d in default_shipped_heads().values()}
    assert kinds == {"lens"}  # the context head shipped by name (smollm2_135m+context) is no default
    want = kinds.pop() if len(kinds) == 1 else "default"
    assert default.path == "default" and spec_kind(default) == want and not changes_model(default)
    with pytest.raises(SelfSpecError, match=r"^heads: 'default': head.path=default: no head ships for this model"):
        build(default, tiny)
    with pytest.raises(SelfSpecError, match="^heads: give at least one"):
        AnalysisConfig(heads=[])


def test_trained_head_directory_is_scored(tiny, tmp_path, seqs):
    from selfspec.heads import save_head

    head = build_head(make_head_config("medusa", exit_layer=3), tiny.backbone)
    randomize_head(head, seed=7, std=0.05)
    save_head(head, tmp_path / "h", tiny.backbone)
    spec = parse_heads([str(tmp_path / "h")])[0]
    assert spec == HeadEntry(str(tmp_path / "h"), path=str(tmp_path / "h"))
    loaded = build(spec, tiny)
    a, _ = score_heads(tiny.backbone, {"x": head}, seqs[:1], TOPK)
    b, _ = score_heads(tiny.backbone, {"x": loaded}, seqs[:1], TOPK)
    assert torch.equal(a["x"][0].correct, b["x"][0].correct)


def test_answers_cache(tiny, tmp_path):
    items = builtin_prompts(limit=1)
    r = Renderer(tiny.tokenizer, False)
    first, path, cached = load_or_generate(tiny, r, items, 8, tmp_path)
    again, path2, cached2 = load_or_generate(tiny, r, items, 8, tmp_path)
    assert (cached, cached2, path2) == (False, True, path) and again == first
    _, path3, cached3 = load_or_generate(tiny, r, items, 9, tmp_path)  # max_new_tokens is part of the key
    assert not cached3 and path3 != path
    path.write_text("{not json")  # a damaged cache is regenerated, not trusted
    third, _, cached4 = load_or_generate(tiny, r, items, 8, tmp_path)
    assert not cached4 and third == first


# ------------------------------------------------------------------------------------------------ the CLI
TINY = ["model=tiny", "+model.random_init.initializer_range=0.3", "logger=none", "prompts.limit=1", "prompts.per_category=true",
        "prompts.categories=[writing,qa]", "max_new_tokens=10"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "SELFSPEC_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "selfspec.analyze", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cli_writes_files_and_reuses_answers(tmp_path):
    out = tmp_path / "run"
    proc = _run([*TINY, "heads=[lens@1-2,medusa@2]", "costs=false", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "analysis.json").read_text())
    assert list(res["heads"]) == ["lens@1", "lens@2", "medusa@2"]
    assert not res["run"]["answers_cached"] and res["run"]["costs"] is None
    h = res["heads"]["lens@2"]
    assert 0 <= h["overall"]["agreement"] <= 1 and set(h["per_category"]) == {"writing", "qa"}
    assert res["run"]["prompts"] == 2 and res["run"]["sequences"] == 3  # writing has two turns
    assert "| `medusa@2` |" in (out / "analysis.md").read_text()
    for png in ("agreement_vs_exit_layer.png", "tau_vs_k.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "speedup_vs_k.png").exists()

    out2 = tmp_path / "run2"  # same prompts and model: answers from the cache; costs timed this time
    proc = _run([*TINY, "heads=[lens@2]", "timing.repeats=1", "timing.warmup=0", "draft_lens=[1,2]",
                 "lookup_first=true", "lookup_len=2", "lookup_min_ngram=1", f"hydra.run.dir={out2}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res2 = json.loads((out2 / "analysis.json").read_text())
    assert res2["run"]["answers_cached"] and res2["heads"]["lens@2"]["overall"]["agreement"] == h["overall"]["agreement"]
    p = res2["heads"]["lens@2"]["predicted"]
    assert set(p["speedup"]) == {"1", "2"} and all(v > 0 for v in p["speedup"].values())
    assert (out2 / "speedup_vs_k.png").exists()
    # end to end (the prompts' prefill counted for both paths): between 1 and the decode-only replayed speedup
    fit = res2["run"]["costs"]["prefill_fit"]
    assert fit["a"] * 20 + fit["b"] * 400 > 0  # a 20-token prefill takes time
    for k, e2e in p["end_to_end"].items():
        s = p["speedup_replay"][k]
        assert min(1.0, s) <= e2e <= max(1.0, s)
    assert "End to end, as `selfspec.eval` measures it" in (out2 / "analysis.md").read_text()
    lf = res2["heads"]["lens@2"]["lookup_first"]  # the lookup-first rounds, replayed and predicted
    assert lf["settings"] == {"len": 2, "min_ngram": 1, "max_ngram": 3} and set(lf["per_category"]) == {"writing", "qa"}
    for k in ("1", "2"):
        assert 1.0 <= lf["replay"][k]["tau"] <= int(k) + 1 and 0 <= lf["replay"][k]["lookup_rounds"] <= 1
        assert lf["speedup"][k] > 0 and min(1.0, lf["speedup"][k]) <= lf["end_to_end"][k] <= max(1.0, lf["speedup"][k])
    assert "## Lookup first (decode.lookup_mode=first)" in (out2 / "analysis.md").read_text()


def test_cli_bad_heads_one_line(tmp_path):
    """Checked before the model loads; exit layers (after it) raise the same way (test_head_entries_expand_and_check)."""
    proc = _run([*TINY, "heads=[lens@2,bogus]", "costs=false", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: heads: 'bogus': neither TYPE"), proc.stderr[-2000:]
    assert not (tmp_path / "run" / "analysis.json").exists()


def test_parallel_drafts_in_the_analysis_and_its_report(tiny, tmp_path, seqs):
    """A saved medusa head with 3 heads: analyze_heads adds its rounds of 3 drafts per pass (offset agreement, tau,
    the cost c_3 of a 3-head pass, the predicted speedup with ceil(K/3) passes per round), and analysis.md shows them."""
    from selfspec.analysis.pipeline import analyze_heads
    from selfspec.analysis.report import analysis_markdown
    from selfspec.heads import save_head

    head = build_head(make_head_config("medusa", exit_layer=3, num_heads=3), tiny.backbone)
    randomize_head(head, seed=2, std=0.05)
    save_head(head, tmp_path / "h3", tiny.backbone)
    cfg = AnalysisConfig(heads=["lens@3", str(tmp_path / "h3")], max_new_tokens=MAX_NEW, draft_lens=[1, 3, 4],
                         timing={"repeats": 1, "warmup": 0})
    res = analyze_heads(tiny, seqs, parse_heads(cfg.heads), cfg)
    assert "parallel" not in res["heads"]["lens@3"]
    par = res["heads"][str(tmp_path / "h3")]["parallel"]
    o = par["overall"]
    assert par["tokens_per_pass"] == 3 and len(o["ahead_agreement"]) == 2
    assert all(0.0 <= a <= 1.0 for a in o["ahead_agreement"]) and par["draft_cost"] > 0
    assert o["replay"][4]["passes"] < o["replay"][4]["drafted"]  # two passes per round of 4
    c, v = par["draft_cost"], res["heads"][str(tmp_path / "h3")]["verify_cost"]
    assert par["predicted"]["speedup"][4] == pytest.approx(o["tau"][4] / (2 * c + v[4]))
    res["run"].update(answers_cached=True, answers_file="x.json")
    md = analysis_markdown(res)
    assert "## Several drafts per pass (decode.tokens_per_pass)" in md and f"| `{tmp_path / 'h3'}` | 3 |" in md
