"""Results as records: the bootstrap interval, the records in results/ and the tables rendered from them. The README's
results table and BENCHMARKS.md's "Where things stand" must equal their rendering from results/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfspec.cli import results as cli
from selfspec.errors import SelfSpecError
from selfspec.evaluation import results as res
from selfspec.evaluation.report import bootstrap_ratio_ci

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_and_benchmarks_tables_equal_their_rendering_from_results():
    records = res.load_records(ROOT / "results")
    assert records, "results/ holds the records behind the README's numbers"
    for path, text in cli.documents(ROOT, records).items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} differs: python -m selfspec.cli.results --write"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    assert len(section.splitlines()) <= 40 and len(section) <= 4000  # one screen
    bench = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert any(res.BEGIN in line for line in bench[:40]) and bench[bench.index(res.BEGIN) + 1].startswith("| model |")


def test_testbed_records_are_in_benchmarks_not_in_the_readme():
    """A model.off_grid record (a testbed, not the model users load) shows in BENCHMARKS.md's table only."""
    records = res.load_records(ROOT / "results")
    testbeds = [name for name, rec in records if res.is_testbed(rec)]
    assert testbeds and all(res.is_testbed(rec) == ("-offgrid" in rec["model"]["name"]) for _, rec in records)
    docs = cli.documents(ROOT, records)
    readme, bench = docs[ROOT / "README.md"], docs[ROOT / "BENCHMARKS.md"]
    assert all(f"(results/{n})" in bench and f"(results/{n})" not in readme for n in testbeds)


def test_every_readme_row_names_its_record_and_cpu():
    records = res.load_records(ROOT / "results")
    table = res.render_table(records)
    for name, rec in records:
        assert f"(results/{name})" in table
        assert f"model {rec['machine']['cpu']['model']}" in table
        assert all(m.get("lossless") in (None, 1.0) for m in rec["methods"].values()), name  # every published run lossless


def test_the_bootstrap_interval_covers_the_estimate_and_narrows_with_more_prompts():
    import random

    rng = random.Random(0)
    mine = [(128.0, rng.uniform(1.5, 2.5)) for _ in range(60)]
    ref = [(128.0, rng.uniform(3.0, 4.0)) for _ in range(60)]
    point = (sum(t for t, _ in mine) / sum(s for _, s in mine)) / (sum(t for t, _ in ref) / sum(s for _, s in ref))
    lo, hi = bootstrap_ratio_ci(mine, ref)
    assert lo < point < hi
    lo6, hi6 = bootstrap_ratio_ci(mine[:6], ref[:6])
    assert hi6 - lo6 > hi - lo
    assert bootstrap_ratio_ci(mine[:6], ref[:6]) == (lo6, hi6)  # seeded: the same numbers every time
    assert bootstrap_ratio_ci(mine[:1], ref[:1]) is None


def test_bad_records_are_refused_with_one_line(tmp_path):
    (tmp_path / "a.json").write_text("{nope")
    with pytest.raises(SelfSpecError, match=r"^results: a.json is not valid JSON"):
        res.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"schema": "other/9"}))
    with pytest.raises(SelfSpecError, match=r"^results: a.json: schema 'other/9', expected 'selfspec-result/1'$"):
        res.load_records(tmp_path)


def test_check_fails_when_a_document_is_stale_and_write_mends_it(tmp_path, capsys):
    src = ROOT / "results"
    (tmp_path / "results").mkdir()
    for f in src.glob("*.json"):
        (tmp_path / "results" / f.name).write_text(f.read_text())
    for doc in ("README.md", "BENCHMARKS.md"):
        text = (ROOT / doc).read_text(encoding="utf-8")
        (tmp_path / doc).write_text(res.replace_region(text, "| stale |\n", doc))
    args = ["--dir", str(tmp_path / "results"), "--root", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--check"])
    assert exc.value.code == 1 and "README.md, BENCHMARKS.md differ" in capsys.readouterr().err
    cli.main([*args, "--write"])
    cli.main([*args, "--check"])  # no exit: current
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text()
