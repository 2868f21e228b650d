"""head=auto (selfspec/heads/auto.py): the shipped candidate with the best predicted speedup from its measured
profile and this machine's step costs; a GPU-like cost profile, where a full-depth draft costs about a step, picks a
cheap head instead of the full-depth self-draft."""

from __future__ import annotations

import json
import math

import pytest

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.heads import HeadConfig
from selfspec.heads import auto
from selfspec.heads.auto import Candidate, Costs, Profile, auto_head_config, choose, machine_costs, parse_candidates

# Profiles of the shape the shipped SmolLM2 candidates have (per verify step: tau, draft passes, verify rows).
FULL_DEPTH = Candidate("int4_mlp self-draft, lookup first", "default", Profile(5.7, 4.3, 6.0), "int4_mlp")
INT8 = Candidate("int8 self-draft, lookup first", "default", Profile(5.6, 4.3, 6.0), "int8")
CONTEXT = Candidate("context head, lookup first", "smollm2_135m+context", Profile(2.1, 1.3, 3.3))
LOOKUP = Candidate("context lookup alone", None, Profile(1.5, 0.0, 2.4), decode={"lookup": True})
CANDS = [FULL_DEPTH, INT8, CONTEXT, LOOKUP]


def test_on_a_cpu_the_cheap_full_depth_copy_wins():
    # CPU: a step reads bytes, so an int4_mlp draft through all layers costs ~0.29 of a step, verify rows are cheap
    cpu = {FULL_DEPTH.name: Costs(0.29, 1.2), INT8.name: Costs(0.31, 1.2), CONTEXT.name: Costs(0.17, 1.05),
           LOOKUP.name: Costs(0.0, 1.1)}
    choice = choose(CANDS, cpu)
    assert choice.candidate is FULL_DEPTH
    assert [r["name"] for r in choice.table] == [c.name for c in CANDS]
    best = choice.table[0]
    assert best["predicted"] == pytest.approx(5.7 / (4.3 * 0.29 + 1.2), abs=1e-3)
    assert "head=auto chose int4_mlp self-draft" in choice.reason and "c=0.290" in choice.reason


def test_on_a_gpu_like_profile_a_cheap_head_beats_the_full_depth_draft():
    # GPU: steps are bound by kernel launches: a full-depth draft costs about a whole step, a 2-layer one a tenth
    gpu = {FULL_DEPTH.name: Costs(1.0, 1.0), INT8.name: Costs(1.0, 1.0), CONTEXT.name: Costs(0.12, 1.0),
           LOOKUP.name: Costs(0.0, 1.0)}
    choice = choose(CANDS, gpu)
    assert choice.candidate is CONTEXT
    assert choice.table[2]["predicted"] > max(r["predicted"] for i, r in enumerate(choice.table) if i != 2)


def test_ties_go_to_the_earlier_candidate_and_costs_must_cover_every_candidate():
    same = {c.name: Costs(0.3, 1.2) for c in (FULL_DEPTH, INT8)}
    twin = Candidate("twin", "default", FULL_DEPTH.profile, "int8")
    assert choose([FULL_DEPTH, twin], {FULL_DEPTH.name: same[FULL_DEPTH.name], "twin": Costs(0.299, 1.2)}).candidate is FULL_DEPTH
    with pytest.raises(SelfSpecError, match="no candidates"):
        choose([], {})


def test_bad_profiles_in_a_head_config_are_refused_with_one_line():
    good = {"name": "x", "head": None, "profile": {"tau": 1.5, "draft_passes": 0, "verify_rows": 2}}
    assert parse_candidates({"candidates": [good]}, "cfg")[0].profile == Profile(1.5, 0.0, 2.0)
    for bad in ({"tau": 0.5, "draft_passes": 0, "verify_rows": 2}, {"tau": 2, "draft_passes": -1, "verify_rows": 2},
                {"tau": float("nan"), "draft_passes": 0, "verify_rows": 2}, {"tau": 2, "verify_rows": 2}):
        with pytest.raises(SelfSpecError, match=r"^cfg: auto.candidates\[0\].profile: "):
            parse_candidates({"candidates": [{**good, "profile": bad}]}, "cfg")


@pytest.fixture
def tiny_candidates(tmp_path, monkeypatch):
    """Candidates on a tiny llama: a lens at E=L in int8 (the full-depth self-draft), a lens at E=1, lookup alone."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    m = make_tiny("llama", head="lens", exit_layer=4)
    m.head.save_pretrained(tmp_path / "full")
    m.set_head("lens", exit_layer=1)
    m.head.save_pretrained(tmp_path / "low")
    cands = [Candidate("full", str(tmp_path / "full"), Profile(3.0, 2.0, 3.0), "int8"),
             Candidate("low", str(tmp_path / "low"), Profile(1.4, 1.0, 2.0)),
             Candidate("lookup", None, Profile(1.2, 0.0, 1.5), decode={"lookup": True})]
    monkeypatch.setattr(auto, "candidates_for", lambda backbone: cands)
    return m, cands


def test_costs_are_measured_through_each_candidates_own_drafter_and_cached_per_machine(tiny_candidates, monkeypatch):
    m, cands = tiny_candidates
    monkeypatch.setattr(auto, "COST_REPEATS", 2)
    costs, source = machine_costs(m.backbone, cands)
    assert source == "measured" and set(costs) == {"full", "low", "lookup"}
    assert all(math.isfinite(c.verify) and c.verify > 0 for c in costs.values())
    assert costs["full"].draft > 0 and costs["low"].draft > 0 and costs["lookup"].draft == 0.0
    again, source = machine_costs(m.backbone, cands)
    assert source == "cached" and again == costs
    files = list((auto.cache_dir() / "auto").glob("*.json"))
    assert len(files) == 1
    files[0].write_text("{not json")
    _, source = machine_costs(m.backbone, cands)  # a damaged cache file is measured again
    assert source == "measured" and json.loads(files[0].read_text())["costs"].keys() == costs.keys()


def test_the_chosen_candidate_becomes_the_heads_config_and_lookup_alone_has_no_head(tiny_candidates):
    m, cands = tiny_candidates
    stated = {"full": Costs(0.3, 1.1), "low": Costs(0.2, 1.0), "lookup": Costs(0.0, 1.0)}
    hcfg, decode, choice = auto_head_config(m.backbone, HeadConfig(path="auto"), stated)
    assert choice.candidate.name == "full" and hcfg.path == cands[0].head and hcfg.draft_precision == "int8"
    assert decode == {} and choice.costs_source == "given"
    stated["lookup"] = Costs(0.0, 0.5)  # verify at half a step: lookup alone predicted 2.4x
    hcfg, decode, choice = auto_head_config(m.backbone, HeadConfig(path="auto"), stated)
    assert hcfg is None and decode == {"lookup": True} and choice.candidate.name == "lookup"


def test_a_model_with_no_candidates_falls_back_to_the_default_head():
    m = make_tiny("llama")
    hcfg, decode, choice = auto_head_config(m.backbone, HeadConfig(path="auto"))
    assert (hcfg.path, decode, choice) == ("default", {}, None)


def test_the_shipped_smollm2_candidates_parse_and_include_each_kind():
    from selfspec.heads.saving import shipped_heads

    path = shipped_heads()["smollm2_135m"] / "head_config.json"
    cands = parse_candidates(json.loads(path.read_text())["auto"], str(path))
    kinds = {(c.head, c.draft_precision) for c in cands}
    assert {("default", "int4_a8"), ("default", "int4_mlp"), ("default", "int8")} <= kinds
    assert any(c.head == "smollm2_135m+context" for c in cands) and any(c.head is None for c in cands)
    assert all(c.profile.source for c in cands)


def test_generate_with_head_auto_says_what_it_chose_and_stays_lossless(tiny_candidates, monkeypatch):
    m, cands = tiny_candidates
    stated = {"full": Costs(0.3, 1.1), "low": Costs(0.2, 1.0), "lookup": Costs(0.0, 1.0)}
    monkeypatch.setattr(auto, "machine_costs", lambda backbone, cs: (stated, "cached"))
    ids = list(range(5, 40))
    ref = m.generate(ids, max_new_tokens=24, strategy="autoregressive").token_ids
    m.set_head("auto")
    out = m.generate(ids, max_new_tokens=24)
    assert m.head.exit_layer == 4 and m.head.draft_precision == "int8"
    assert out.auto["chosen"] == "full" and out.auto["reason"].startswith("head=auto chose full")
    assert out.token_ids == ref
    stated["lookup"] = Costs(0.0, 0.4)
    m.set_head("auto")
    out = m.generate(ids, max_new_tokens=24)
    assert m.head is None and out.decode.lookup and "lookup" in out.tuned_from_head
    assert out.auto["chosen"] == "lookup" and out.token_ids == ref
    m.set_head("lens", exit_layer=1)
    assert m.auto_choice is None and m.generate(ids, max_new_tokens=4).auto is None
