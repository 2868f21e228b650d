"""selfspec.utils.markdown: the one table renderer."""

from selfspec.utils.markdown import LEFT, RIGHT, table


def test_table_lines_alignment_and_escaping() -> None:
    assert table(["a", "b"], [[1, "x"], [2.5, None]]) == ["| a | b |", "|---|---|", "| 1 | x |", "| 2.5 | None |"]
    assert table(["name", "n"], [], align=[LEFT, RIGHT])[1] == "|---|---:|"
    # a pipe would split the cell, a newline would end the row
    assert table(["e"], [["a|b\nc"]])[2] == "| a\\|b c |"
