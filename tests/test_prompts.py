"""Tests for the prompt-data layer (selfspec.data.prompts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfspec.data import PromptItem, builtin_prompts, load_prompts
from selfspec.errors import SelfSpecError

SPEC_BENCH_FILE = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"


def write_jsonl(path: Path, lines: list) -> Path:
    """Write each entry as one line: dicts are JSON-encoded, strings are written verbatim (for bad input)."""
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines), encoding="utf-8")
    return path


def spec(qid, category, *turns, **extra):
    return {"question_id": qid, "category": category, "turns": list(turns), **extra}


# --------------------------------------------------------------------------------------------------
# formats
# --------------------------------------------------------------------------------------------------


def test_spec_bench_format(tmp_path):
    path = write_jsonl(
        tmp_path / "q.jsonl",
        [
            spec(81, "writing", "Write a poem.", "Now shorten it."),
            spec(82, "math", "What is 2+2?", reference=["4", "four"]),
        ],
    )
    items = load_prompts(path, fmt="spec_bench")
    assert items == [
        PromptItem(id="81", category="writing", turns=("Write a poem.", "Now shorten it.")),
        PromptItem(id="82", category="math", turns=("What is 2+2?",), reference="4\n\nfour"),
    ]


def test_sharegpt_jsonl(tmp_path):
    record = {
        "id": "abc",
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "user", "value": "Tell me a joke"},
            {"from": "assistant", "value": "..."},
        ],
    }
    items = load_prompts(write_jsonl(tmp_path / "s.jsonl", [record]), fmt="sharegpt")
    assert items == [PromptItem(id="abc", category="default", turns=("Hi", "Tell me a joke"))]


def test_sharegpt_json_list_and_role_content_spelling(tmp_path):
    records = [
        {"id": "x7", "conversations": [{"from": "human", "value": "A"}, {"from": "gpt", "value": "B"}]},
        {"conversations": [{"role": "user", "content": "C"}]},  # OpenAI spelling, no id
    ]
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    items = load_prompts(path)
    assert [(i.id, i.turns) for i in items] == [("x7", ("A",)), ("1", ("C",))]


def test_pretty_printed_list_with_jsonl_name(tmp_path):
    path = tmp_path / "dump.jsonl"
    path.write_text(json.dumps([{"prompt": "x"}, {"prompt": "y"}], indent=2), encoding="utf-8")
    assert [i.turns for i in load_prompts(path)] == [("x",), ("y",)]


def test_jsonl_content_with_json_name(tmp_path):
    path = write_jsonl(tmp_path / "q.json", [{"prompt": "x"}, {"prompt": "y"}])
    assert [i.id for i in load_prompts(path)] == ["0", "1"]


def test_nested_spec_bench_reference(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [spec(1, "rag", "q", reference=[["a", "b"], "c"])])
    assert load_prompts(path)[0].reference == "a; b\n\nc"


def test_json_list_default_id_is_position(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps([{"prompt": "x"}, {"prompt": "y"}]), encoding="utf-8")
    assert [i.id for i in load_prompts(path)] == ["0", "1"]


def test_single_object_json_file(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"prompt": "only one"}, indent=2), encoding="utf-8")
    assert load_prompts(path) == [PromptItem(id="0", category="default", turns=("only one",))]


def test_prompt_and_text_format(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "first", "category": "qa", "id": "p1"}, {"text": "second"}],
    )
    items = load_prompts(path, fmt="prompt")
    assert items == [
        PromptItem(id="p1", category="qa", turns=("first",)),
        PromptItem(id="1", category="default", turns=("second",)),
    ]


def test_auto_detects_mixed_records_and_skips_blank_lines(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps(spec(1, "writing", "a", "b")),
                "",
                "   ",
                json.dumps({"conversations": [{"from": "human", "value": "c"}]}),
                json.dumps({"text": "d"}),
                "",
            ]
        ),
        encoding="utf-8",
    )
    items = load_prompts(path)  # fmt="auto" is the default
    assert [i.turns for i in items] == [("a", "b"), ("c",), ("d",)]
    # missing ids fall back to the 0-based line index (blank lines counted, so it points at the line)
    assert [i.id for i in items] == ["1", "3", "4"]
    assert [i.category for i in items] == ["writing", "default", "default"]


def test_raw_line_separator_inside_string_is_not_a_line_break(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_prompts(path)[0].turns == ("a\u2028b",)


def test_utf8_bom_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hi"}).encode() + b"\n")
    assert load_prompts(path)[0].turns == ("hi",)


# --------------------------------------------------------------------------------------------------
# limit and categories
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def three_categories(tmp_path):
    return write_jsonl(
        tmp_path / "c.jsonl",
        [spec(i, cat, f"q{i}") for i, cat in enumerate(["a", "b", "a", "c", "a", "b"])],
    )


def test_limit(three_categories):
    assert [i.id for i in load_prompts(three_categories, limit=2)] == ["0", "1"]
    assert len(load_prompts(three_categories, limit=100)) == 6


def test_categories_filter_then_limit(three_categories):
    items = load_prompts(three_categories, categories=["a", "c"])
    assert [i.id for i in items] == ["0", "2", "3", "4"]
    # limit counts after the filter
    assert [i.id for i in load_prompts(three_categories, categories=["a"], limit=2)] == ["0", "2"]
    # a bare string means one category; an empty list means no filter
    assert len(load_prompts(three_categories, categories="b")) == 2
    assert len(load_prompts(three_categories, categories=[])) == 6


def test_unknown_category_lists_present_ones(three_categories):
    with pytest.raises(SelfSpecError) as err:
        load_prompts(three_categories, categories=["a", "zzz"])
    msg = str(err.value)
    assert "'zzz'" in msg and "a, b, c" in msg and str(three_categories) in msg
    assert "\n" not in msg


@pytest.mark.parametrize("limit", [0, -3, True, 2.5, "5"])
def test_bad_limit(three_categories, limit):
    with pytest.raises(SelfSpecError, match="data.limit"):
        load_prompts(three_categories, limit=limit)


def test_bad_format_names_allowed_values(three_categories):
    with pytest.raises(SelfSpecError) as err:
        load_prompts(three_categories, fmt="alpaca")
    msg = str(err.value)
    assert "data.format" in msg
    for allowed in ("auto", "spec_bench", "sharegpt", "prompt"):
        assert allowed in msg


def test_forced_format_mismatch(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, spec(1, "w", "y")])
    with pytest.raises(SelfSpecError, match=r"line 1: data.format=spec_bench but the record has no 'turns'"):
        load_prompts(path, fmt="spec_bench")
    with pytest.raises(SelfSpecError, match=r"line 2: data.format=prompt"):
        load_prompts(path, fmt="prompt")


# --------------------------------------------------------------------------------------------------
# malformed input: one-line SelfSpecError naming the file and the 1-based line
# --------------------------------------------------------------------------------------------------

GOOD = json.dumps({"prompt": "fine"})

MALFORMED = [
    # (lines of the file, line expected in the message, text expected in the message)
    ([GOOD, GOOD, '{"prompt": "x" "y"}'], 3, "not valid JSON (Expecting ',' delimiter)"),
    ([GOOD, '{"prompt": '], 2, "not valid JSON"),
    (
        [GOOD, json.dumps({"question": "no known key"})],
        2,
        "record has none of 'turns', 'conversations', 'prompt', 'text'",
    ),
    ([json.dumps(["a", "list"])], 1, "record must be a JSON object"),
    ([GOOD, GOOD, GOOD, json.dumps(["a", "list"])], 4, "record must be a JSON object"),
    ([GOOD, json.dumps({"turns": []})], 2, "turns must be a non-empty list of strings"),
    ([GOOD, json.dumps({"turns": "just a string"})], 2, "turns must be a non-empty list of strings"),
    ([json.dumps({"turns": ["ok", 3]})], 1, "turns must be a non-empty list of strings"),
    ([json.dumps({"turns": ["ok", "  "]})], 1, "turns must be a non-empty list of strings"),
    ([GOOD, json.dumps({"conversations": []})], 2, "conversations must be a non-empty list"),
    ([json.dumps({"conversations": [{"from": "gpt", "value": "only the bot"}]})], 1, "no 'human' or 'user' message"),
    ([json.dumps({"conversations": ["not a dict"]})], 1, "conversations[0]"),
    ([json.dumps({"conversations": [{"value": "no speaker"}]})], 1, "conversations[0] has no 'from'"),
    ([json.dumps({"conversations": [{"from": "human", "value": ""}]})], 1, "non-empty 'value'"),
    ([GOOD, json.dumps({"prompt": ""})], 2, "'prompt' must be a non-empty string"),
    ([json.dumps({"text": 12})], 1, "'text' must be a non-empty string"),
    ([json.dumps({"prompt": "x", "category": 5})], 1, "'category' must be a non-empty string"),
    ([json.dumps({"prompt": "x", "id": {"a": 1}})], 1, "'id' must be a string or integer"),
    ([json.dumps({"prompt": "x", "reference": 3})], 1, "'reference' must be a string or a list of strings"),
    ([json.dumps({"prompt": "x", "reference": [[1]]})], 1, "'reference' must be a string or a list of strings"),
]


@pytest.mark.parametrize("lines,line_no,expected", MALFORMED)
def test_malformed_record(tmp_path, lines, line_no, expected):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(SelfSpecError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert f"data.path={path} line {line_no}:" in msg
    assert expected in msg
    assert "\n" not in msg


def test_line_number_counts_blank_lines(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text(GOOD + "\n\n\n" + "{oops}\n", encoding="utf-8")
    with pytest.raises(SelfSpecError, match=r"line 4: not valid JSON"):
        load_prompts(path)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"prompt": "Gr\u00fc\u00dfe"}'.encode("latin-1") + b"\n")
    with pytest.raises(SelfSpecError, match=r"line 2: not valid UTF-8"):
        load_prompts(path)


def test_malformed_json_list(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b",}\n]\n', encoding="utf-8")
    with pytest.raises(SelfSpecError) as err:
        load_prompts(path)
    assert f"data.path={path} line 3: not valid JSON" in str(err.value)


def test_bad_record_inside_json_list_names_record(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"nothing": 1}]), encoding="utf-8")
    with pytest.raises(SelfSpecError, match=r"record 2: record has none of"):
        load_prompts(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(SelfSpecError) as err:
        load_prompts(path)
    assert str(err.value) == f"data.path={path}: file not found"


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(SelfSpecError, match="is a directory"):
        load_prompts(tmp_path)


@pytest.mark.parametrize("name,content", [("e.jsonl", ""), ("e.jsonl", "\n\n   \n"), ("e.json", "[]"), ("e.json", "")])
def test_empty_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SelfSpecError) as err:
        load_prompts(path)
    assert str(path) in str(err.value) and "no records" in str(err.value)


# --------------------------------------------------------------------------------------------------
# built-in set and the real Spec-Bench file
# --------------------------------------------------------------------------------------------------


def test_builtin_prompts():
    items = builtin_prompts()
    categories = {i.category for i in items}
    assert len(items) >= 60
    assert len(categories) >= 6
    assert {"writing", "translation", "summarization", "qa", "math_reasoning", "rag"} <= categories
    assert len({i.id for i in items}) == len(items)  # ids are unique
    for item in items:
        if item.category == "writing":
            assert len(item.turns) == 2
        for turn in item.turns:
            assert len(turn.split()) < 250


def test_builtin_prompts_filter_and_limit():
    items = builtin_prompts(limit=3, categories=["rag"])
    assert len(items) == 3 and all(i.category == "rag" for i in items)
    with pytest.raises(SelfSpecError, match="categories present"):
        builtin_prompts(categories=["coding"])


@pytest.mark.skipif(not SPEC_BENCH_FILE.is_file(), reason=f"{SPEC_BENCH_FILE} not present")
def test_real_spec_bench_file():
    items = load_prompts(SPEC_BENCH_FILE)
    assert len(items) == 480
    assert len({i.category for i in items}) >= 6
    assert all(i.turns for i in items)
    assert len(load_prompts(SPEC_BENCH_FILE, categories=["translation"], limit=5)) == 5
