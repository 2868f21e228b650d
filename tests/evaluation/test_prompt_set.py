"""selfspec.evaluation.prompt_set (conf/prompts/): an evaluation's prompt set, its categories and limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from selfspec.errors import SelfSpecError
from selfspec.evaluation.prompt_set import load_prompt_set, prompt_set_config
from selfspec.utils.paths import conf_dir


def load_items(node) -> list:
    return load_prompt_set(prompt_set_config(node))


def test_path_required_for_spec_bench() -> None:
    with pytest.raises(SelfSpecError, match="prompts.path: required"):
        load_items(OmegaConf.load(conf_dir() / "prompts" / "spec_bench.yaml"))


def test_selection(tmp_path: Path) -> None:
    items = load_items({"path": None, "limit": 2, "per_category": True})
    cats = [it.category for it in items]
    assert len(items) == 12 and all(cats.count(c) == 2 for c in set(cats))
    assert len(load_items({"limit": 3})) == 3
    assert {it.category for it in load_items({"categories": ["qa", "rag"]})} == {"qa", "rag"}
    with pytest.raises(SelfSpecError, match="prompts.categories"):
        load_items({"categories": ["nope"]})

    f = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": c, "turns": ["a?", "b?"] if c == "writing" else ["a?"]}
            for i, c in enumerate(["writing", "roleplay", "qa", "qa", "writing"])]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Spec-Bench's MT-bench categories become one task.
    items = load_items({"path": str(f), "limit": 1, "per_category": True, "spec_bench_tasks": True})
    assert [(it.category, len(it.turns)) for it in items] == [("mt_bench", 2), ("qa", 1)]


def test_bad_values_name_the_key(tmp_path: Path) -> None:
    # A key of training's data group (or a typo) is refused, not silently ignored.
    with pytest.raises(SelfSpecError, match="prompts: unknown key.*num_prompts"):
        load_items({"num_prompts": 3})
    with pytest.raises(SelfSpecError, match=r"prompts.limit=0: must be an integer >= 1"):
        load_items({"limit": 0})
    with pytest.raises(SelfSpecError, match="prompts.format='xml'"):
        load_items({"format": "xml"})
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(SelfSpecError, match=r"^prompts.path=.*line 2: not valid JSON"):
        load_items({"path": str(bad)})


def test_every_prompt_set_composes_in_eval(tmp_path: Path) -> None:
    """`prompts=jsonl prompts.path=FILE` with the keys every prompt set has (no `+` needed)."""
    from hydra import compose, initialize_config_dir

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Hello there", "category": "a"}\n{"prompt": "Bye", "category": "b"}\n')
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("eval", overrides=["prompts=jsonl", f"prompts.path={f}", "prompts.limit=1"])
        assert [it.turns for it in load_items(cfg.prompts)] == [("Hello there",)]
        cfg = compose("eval", overrides=["prompts=jsonl", f"prompts.path={f}", "prompts.categories=[b]"])
        assert [it.turns for it in load_items(cfg.prompts)] == [("Bye",)]
        assert compose("eval").prompts.per_category is False
        cfg = compose("eval", overrides=["prompts=spec_bench", f"prompts.path={f}"])
        assert cfg.prompts.format == "spec_bench" and cfg.prompts.spec_bench_tasks is True
        assert len(load_items(compose("eval").prompts)) == 60  # the built-in set
