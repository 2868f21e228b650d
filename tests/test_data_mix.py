"""data=mix: the .mo parser, the context prompt builders, dedup and the evaluation-overlap filter, the held-out
split, the mix's config, and a build on a tiny model that writes shards and resumes from them."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from selfspec.training.mix import catalogs, contexts
from selfspec.training.mix.contexts import Prompt
from selfspec.data.dedup import TextNgrams, dedup, normalize
from selfspec.training.mix.build import Excluder, MixConfig, allocate, hold_out, mix_config
from selfspec.errors import SelfSpecError


# ------------------------------------------------------------------------------------------------ .mo files
def write_mo(path: Path, entries: list[tuple[bytes, bytes]], order: str = "<", magic: int = 0x950412DE) -> Path:
    """A GNU .mo file: header, then the originals and translations tables, then the strings (sorted by msgid,
    as msgfmt writes them)."""
    entries = sorted(entries)
    n = len(entries)
    orig_at, trans_at = 28, 28 + 8 * n
    data_at = trans_at + 8 * n
    blob, orig, trans = b"", [], []
    for msgid, _ in entries:
        orig.append((len(msgid), data_at + len(blob)))
        blob += msgid + b"\0"
    for _, msgstr in entries:
        trans.append((len(msgstr), data_at + len(blob)))
        blob += msgstr + b"\0"
    head = struct.pack(order + "7I", magic, 0, n, orig_at, trans_at, 0, 0)
    tables = b"".join(struct.pack(order + "2I", *e) for e in orig + trans)
    path.write_bytes(head + tables + blob)
    return path


ENTRIES = [
    (b"", b"Content-Type: text/plain; charset=UTF-8\n"),
    (b"Cannot open the file for reading.", "Die Datei kann nicht zum Lesen geöffnet werden.".encode()),
    (b"menu\x04_Open the recent file list now", "Die Liste der _letzten Dateien jetzt öffnen".encode()),
    (b"%d file was removed from the archive\x00%d files were removed from the archive",
     b"%d Datei wurde aus dem Archiv entfernt\x00%d Dateien wurden aus dem Archiv entfernt"),
    (b"Quit", b"Beenden"),
    (b"This message has no translation yet.", b""),
]


@pytest.mark.parametrize("order", ["<", ">"])
def test_mo_parser_reads_pairs_in_both_byte_orders(tmp_path: Path, order: str) -> None:
    pairs = dict(catalogs.read_mo(write_mo(tmp_path / "t.mo", ENTRIES, order)))
    assert pairs["Cannot open the file for reading."] == "Die Datei kann nicht zum Lesen geöffnet werden."
    assert pairs["_Open the recent file list now"] == "Die Liste der _letzten Dateien jetzt öffnen"  # context dropped
    assert pairs["%d file was removed from the archive"] == "%d Datei wurde aus dem Archiv entfernt"  # singular
    assert pairs["Quit"] == "Beenden"
    assert "" not in pairs and "This message has no translation yet." not in pairs and len(pairs) == 4


def test_mo_parser_honours_the_header_charset(tmp_path: Path) -> None:
    entries = [(b"", b"Content-Type: text/plain; charset=ISO-8859-1\n"), (b"Open the door", "Öffne die Tür".encode("latin-1"))]
    assert catalogs.read_mo(write_mo(tmp_path / "l.mo", entries)) == [("Open the door", "Öffne die Tür")]


def test_mo_parser_refuses_bad_files(tmp_path: Path) -> None:
    with pytest.raises(SelfSpecError, match="bad magic"):
        catalogs.read_mo(write_mo(tmp_path / "a.mo", ENTRIES, magic=0x12345678))
    good = write_mo(tmp_path / "b.mo", ENTRIES).read_bytes()
    (tmp_path / "c.mo").write_bytes(good[:60])
    with pytest.raises(SelfSpecError, match="truncated"):
        catalogs.read_mo(tmp_path / "c.mo")
    (tmp_path / "d.mo").write_bytes(b"\x00" * 8)
    with pytest.raises(SelfSpecError, match="not a .mo file"):
        catalogs.read_mo(tmp_path / "d.mo")


def test_translation_pairs_keep_prose_only(tmp_path: Path) -> None:
    mo = write_mo(tmp_path / "de.mo", ENTRIES)
    pairs = catalogs.translation_pairs(("de",), catalogs={"de": [mo]})
    english = {p.english for p in pairs}
    assert "Cannot open the file for reading." in english
    assert "Open the recent file list now" in english  # accelerator marks removed
    assert "Quit" not in english  # a label, not a sentence
    assert all(p.language == "de" and p.source == "de" for p in pairs)
    assert catalogs.translation_pairs(("de",), catalogs={"de": [mo]}, limit=1) == pairs[:1]


# ------------------------------------------------------------------------------------------------ builders
def test_writing_and_document_requests_fill_their_templates() -> None:
    rng = random.Random(0)
    writing = contexts.writing_requests(rng, 30)
    assert len({p.group for p in writing}) == 30 and all("{" not in p.text for p in writing)
    doc = ("The Harbour Council met on Monday in Brightwater. " * 3 + "\n\n" + "Mayor Ellen Stone said the plan would cut traffic. " * 4) * 3
    story = next(p for p in writing if p.meta["genre"] != "code")
    reqs = contexts.document_requests(rng, doc, story, 5, max_chars=400)
    assert {p.kind for p in reqs} == set(contexts.DOCUMENT_KINDS)
    for p in reqs:
        assert p.group == story.group and p.source == "documents" and "{" not in p.text
        assert len(p.text) <= 400 + 200  # the context is clipped; the template adds at most a sentence or two
    answer = next(p for p in reqs if p.kind == "answer")
    assert "Based on" in answer.text or "Question" in answer.text or "Answer using" in answer.text or "According" in answer.text


def test_clip_cuts_at_a_boundary() -> None:
    text = "First paragraph here.\n\nSecond paragraph is rather long and keeps going for a while."
    assert contexts.clip(text, 30) == "First paragraph here."
    assert contexts.clip("short", 30) == "short"
    assert len(contexts.clip("word " * 100, 50)) <= 50


def test_package_prompts_from_descriptions() -> None:
    docs = [contexts.PackageDoc(f"pkg{i}", f"Tools for task number {i}.", ("This package does things. " * 30) if i % 2 else "")
            for i in range(6)]
    ps = contexts.package_prompts(random.Random(1), docs, 40, max_chars=300)
    assert len(ps) == 40 and {p.kind for p in ps} >= {"passages"} and len({p.kind for p in ps}) >= 4
    for p in ps:
        assert p.group.startswith("pkg:") and "{" not in p.text and len(p.text) <= 300 + 300
    passages = next(p for p in ps if p.kind == "passages")
    assert passages.text.count("Passage ") == 3
    assert contexts.package_prompts(random.Random(1), [], 5, 300) == []
    real = contexts.package_docs()  # this interpreter's installed distributions
    assert any(d.name.lower() == "torch" for d in real)


SOURCE = '''
def add(a, b):
    """Add two numbers.

    Returns their sum."""
    total = a + b
    if total < 0:
        return 0
    return total


def tiny():
    return 1


class K:
    def method(self, items):
        out = []
        for x in items:
            if x is None:
                continue
            out.append(x + 1)
        return out
'''


def test_code_prompts_from_source(tmp_path: Path) -> None:
    fns = contexts.functions_in(SOURCE, "m.py")
    by_name = {f.name: f for f in fns}
    assert set(by_name) == {"add", "method"}  # `tiny` is too short
    add = by_name["add"]
    assert add.docstring.startswith("Add two numbers") and '"""' not in add.bare and "total = a + b" in add.bare
    assert add.source.startswith("def add") and by_name["method"].source.startswith("def method")  # dedented
    (tmp_path / "m.py").write_text(SOURCE)
    found = contexts.find_functions(random.Random(0), 5, roots=[str(tmp_path)])
    assert {f.name for f in found} <= {"add", "method"} and found
    ps = contexts.code_prompts(random.Random(0), fns * 20, 40, max_chars=2000)
    kinds = {p.kind for p in ps}
    assert len(kinds) >= 4 and all("```python" in p.text or p.kind == "implement" for p in ps)
    for p in ps:
        if p.kind == "fix":  # a mutated copy: not the original code
            assert p.text.split("```python\n")[1].split("\n```")[0] not in (add.bare, by_name["method"].bare)
        if p.kind == "docstring":
            assert "Add two numbers" not in p.text


def test_translation_prompts_both_directions() -> None:
    pairs = [catalogs.TranslationPair("de", f"The file number {i} could not be opened.", f"Die Datei Nummer {i} konnte nicht geöffnet werden.", "x")
             for i in range(20)]
    ps = contexts.translation_prompts(random.Random(0), pairs, 60, max_chars=500)
    kinds = {p.kind for p in ps}
    assert kinds == {"de-en", "en-de"}
    for p in ps:
        if p.kind == "de-en":
            assert "Datei" in p.text and ("English" in p.text)
        else:
            assert "file number" in p.text and "German" in p.text
    assert any(p.text.count("Datei") > 1 for p in ps)  # passages of several messages
    assert contexts.translation_prompts(random.Random(0), [], 5, 500) == []


def test_followup_prompt_is_a_conversation() -> None:
    first = Prompt(("What is a bee?",), "magpie", "magpie", "magpie:3")
    p = contexts.followup_prompts(random.Random(0), first, "An insect.")
    assert p.turns[:2] == ("What is a bee?", "An insect.") and len(p.turns) == 3 and p.group == "magpie:3"
    assert [m["role"] for m in p.messages()] == ["user", "assistant", "user"]
    own = contexts.followup_prompts(random.Random(0), first, "An insect.", second="And a wasp?")
    assert own.text == "And a wasp?"
    assert Prompt.from_json(json.loads(json.dumps(own.to_json()))) == own


# ------------------------------------------------------------------------------------------------ filters and split
def test_dedup_by_normalized_text() -> None:
    items = ["Hello, World!", "hello world", "Hello there", "  HELLO   THERE ", ""]
    assert dedup(items) == ["Hello, World!", "Hello there"]
    assert normalize("A-b, C!") == "a b c"


def test_ngram_overlap_filter(tmp_path: Path) -> None:
    question = "Draft a cheerful newsletter for a rowing club about its autumn regatta, the new boathouse and the volunteers who built it."
    index = TextNgrams([question], n=8)
    assert index.overlap(question) == 1.0
    assert index.overlap("Please " + question.lower() + " Thanks!") > 0.7
    assert index.overlap("Write a short story about a lighthouse keeper who finds a message in a bottle.") == 0.0
    assert index.overlap("rowing club") == 0.0 and TextNgrams(["Rowing club!"], n=8).overlap("rowing CLUB") == 1.0
    evalfile = tmp_path / "question.jsonl"
    evalfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [question, "Rewrite it."]}) + "\n")
    ex = Excluder(MixConfig(exclude=[str(evalfile)], exclude_builtin=False))
    assert ex(f"Context: {question}\n\nSummarize it.") and not ex("Tell me about volcanoes and their eruptions in Iceland.")
    assert ex.dropped == 1 and ex.files == [str(evalfile.resolve())]
    with pytest.raises(SelfSpecError, match="data.mix.exclude: .*missing.jsonl.* is not a file"):  # no longer skipped silently
        MixConfig(exclude=[str(evalfile), str(tmp_path / "missing.jsonl")])
    builtin = Excluder(MixConfig(exclude=[]))  # the builtin evaluation prompts are always excluded
    from selfspec.data import builtin_prompts

    assert builtin(builtin_prompts()[0].turns[0])


def test_hold_out_keeps_groups_on_one_side() -> None:
    ps = [Prompt((f"q{i}-{j}",), src, "k", f"{src}:{i}") for src in ("code", "magpie", "translation") for i in range(10) for j in range(2)]
    ps += [Prompt(("write",), "writing", "news", "doc:0")]
    train, val = hold_out(ps, 7, random.Random(0))
    assert len(val) == 7 and {p.source for p in val} == {"code", "magpie", "translation"}
    val_groups = {p.group for p in val}
    assert not val_groups & {p.group for p in train}
    assert not {p.text for p in val} & {p.text for p in train}
    assert {p.text for p in train} | {p.text for p in val} == {p.text for p in ps}  # nothing else is lost


def test_allocate_splits_by_weight() -> None:
    counts = allocate(100, {"a": 0.5, "b": 0.25, "c": 0.25, "d": 0.0})
    assert counts == {"a": 50, "b": 25, "c": 25, "d": 0}
    counts = allocate(7, {"a": 1.0, "b": 1.0, "c": 1.0})
    assert sum(counts.values()) == 7 and min(counts.values()) == 2


@pytest.mark.parametrize("node, message", [
    ({"weights": {"magpie": 1, "poems": 1}}, "unknown source"),
    ({"weights": {"magpie": -1}}, "data.mix.weights.magpie=-1"),
    ({"weights": {"magpie": 0}}, "at least one weight"),
    ({"weights": {"files": 1}}, "needs data.mix.files"),
    ({"languages": ["xx"]}, "data.mix.languages"),
    ({"shard_prompts": 0}, "data.mix.shard_prompts=0"),
    ({"exclude_overlap": 0}, "data.mix.exclude_overlap"),
    ({"nonsense": 1}, "unknown key"),
])
def test_mix_config_validates(node: dict, message: str) -> None:
    with pytest.raises(SelfSpecError, match=message):
        mix_config(node)


def test_mix_composes_from_the_configs() -> None:
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir
    from selfspec.training.dataset import data_settings
    from selfspec.cli.train import build_configs

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        c = build_configs(compose("train", overrides=["data=mix"]))
        old = build_configs(compose("train", overrides=["data=selfgen_tasks"]))
    assert c.data.source == "mix" and isinstance(c.data.mix, MixConfig) and c.data.synth_dtype == "bfloat16"
    assert abs(sum(c.data.mix.weights.values()) - 1.0) < 1e-9 and c.data.answer_max_tokens == 192
    assert "mix" in data_settings(c.data) and "token_budget" not in data_settings(c.data)
    # the keys added for data=mix leave the other sources' cache keys as they were
    assert not {"mix", "synth_dtype", "token_budget"} & set(data_settings(old.data))


# ------------------------------------------------------------------------------------------------ a build
def test_mix_build_on_a_tiny_model_writes_shards_and_resumes(tmp_path: Path, caplog) -> None:
    from selfspec.training.config import DataConfig
    from selfspec.training.dataset import build_sequences

    m = make_tiny("llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "chat", "turns": [f"Tell me about topic {i}.", "Why?"]})
                                 for i in range(12)) + "\n")
    cfg = DataConfig(source="mix", num_prompts=16, val_prompts=3, prompt_max_tokens=8, answer_max_tokens=8, topk=4,
                     mix={"weights": {"magpie": 1, "files": 2, "multiturn": 1}, "files": [str(prompts)],
                          "shard_prompts": 3, "exclude": []})
    first = build_sequences(m, cfg, progress=False, directory=tmp_path / "ds")
    sources = first.meta["mix"]["sources"]
    assert set(sources) == {"magpie", "files", "multiturn"} and sources["multiturn"]["sequences"] >= 1
    assert len(first.val_prompts) == 3
    trained_texts = set("\n".join(first.train_prompts).split("\n\n"))
    assert not set(first.val_prompts) & trained_texts
    shards = sorted((tmp_path / "ds" / "mix" / "answers-1").glob("shard-*.pt"))
    assert len(shards) >= 2
    # the file's own second turn follows the target's first answer
    multi = [p for p in first.train_prompts if p.endswith("\n\nWhy?")]
    assert multi and first.num_targets == int((first.resp_offsets[1:] - first.resp_offsets[:-1]).sum())

    again = build_sequences(m, cfg, progress=False, directory=tmp_path / "ds")  # everything from the shards
    assert torch.equal(again.tokens, first.tokens) and torch.equal(again.topk_ids, first.topk_ids)

    shards[0].unlink()  # an interruption lost a shard: its prompts are answered again, the same way
    shards[1].write_bytes(shards[1].read_bytes()[:100])  # and a damaged one is noticed
    caplog.clear()
    resumed = build_sequences(m, cfg, progress=False, directory=tmp_path / "ds")
    assert torch.equal(resumed.tokens, first.tokens) and torch.equal(resumed.topk_ids, first.topk_ids)
    assert "damaged" in caplog.text
