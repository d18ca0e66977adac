"""bench/results_md.py: a tool's section of bench/RESULTS.md is replaced in place, between its
marker lines, and nothing else in the file changes. Needs no build."""

import os
import sys

import pytest

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import results_md  # noqa: E402
from results_md import replace_section  # noqa: E402

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
HEAD = "# gradlink benchmark results\n\nIntro, with a mention of `<!-- compare:begin -->` inline.\n\n"
TAIL = "\n## Reducers\n\n| kernel | 64 MiB |\n|---|---|\n| memcpy | 3691 us |\n"


def doc(body):
    return HEAD + BEGIN + "\n" + body + END + "\n" + TAIL


def test_creates_the_markers_when_missing():
    text = HEAD + TAIL
    out = replace_section(text, "compare", "| 4K | 1.00 |\n")
    assert out.startswith(text)  # the old text, byte for byte, then the new section
    assert out[len(text):] == "\n" + BEGIN + "\n| 4K | 1.00 |\n" + END + "\n"
    # a file without a final newline, and an empty file
    assert replace_section("x", "a", "b") == "x\n\n<!-- a:begin -->\nb\n<!-- a:end -->\n"
    assert replace_section("", "a", "b\n") == "<!-- a:begin -->\nb\n<!-- a:end -->\n"


def test_replaces_the_body_when_present():
    old = doc("### 5bc1129 — old run\n\n| 4K | 1.00 |\n")
    out = replace_section(old, "compare", "### abc1234 — new run\n\n| 4K | 0.90 |")
    assert out == doc("### abc1234 — new run\n\n| 4K | 0.90 |\n")
    assert "5bc1129" not in out and out.count(BEGIN + "\n") == 1 and out.count(END) == 1
    # the same body again changes nothing; an empty body leaves the markers adjacent
    assert replace_section(out, "compare", "### abc1234 — new run\n\n| 4K | 0.90 |\n") == out
    assert replace_section(out, "compare", "") == HEAD + BEGIN + "\n" + END + "\n" + TAIL


def test_leaves_the_rest_byte_identical():
    # Other sections, CRLF lines, trailing blanks on a marker line, no final newline.
    head = HEAD + "<!-- netcluster-ps:begin -->\nps table\n<!-- netcluster-ps:end -->\r\n\r\n"
    begin_line = BEGIN + "  \n"
    tail = "\r\n" + END + " trailing? no: this is not a marker line\n" + "last line, no newline"
    text = head + begin_line + "old\n" + END + tail
    out = replace_section(text, "compare", "new\n")
    assert out == head + begin_line + "new\n" + END + tail
    i = out.index("new\n")
    assert out[:i] == text[:text.index("old\n")] and out[i + 4:] == text[text.index("old\n") + 4:]
    # the other section is untouched, and is itself replaceable
    out2 = replace_section(out, "netcluster-ps", "ps v2\n")
    assert out2 == out.replace("ps table\n", "ps v2\n")
    assert results_md.section_body(out2, "compare") == "new\n"
    assert results_md.section_body(out2, "netcluster-ps") == "ps v2\n"
    assert results_md.section_body(out2, "netcluster-mixed") is None


def test_refuses_what_it_cannot_replace_safely():
    for bad in (HEAD + BEGIN + "\nno end\n",                      # begin only
                HEAD + END + "\nno begin\n",                      # end only
                HEAD + END + "\n" + BEGIN + "\n",                 # out of order
                doc("x\n") + BEGIN + "\n" + END + "\n"):          # twice
        with pytest.raises(ValueError):
            replace_section(bad, "compare", "y\n")
    with pytest.raises(ValueError):
        replace_section(doc("x\n"), "compare", "y\n" + END + "\n")  # would cut the next replace
    with pytest.raises(ValueError):
        replace_section("", "bad name", "y")


def test_update_section_and_history(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text(HEAD + TAIL, encoding="utf-8")
    results_md.update_section(str(results), "compare", "first\n")
    results_md.update_section(str(results), "compare", "second\n")
    assert results.read_text(encoding="utf-8") == HEAD + TAIL + "\n" + BEGIN + "\nsecond\n" + END + "\n"
    import datetime
    when = datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)
    hist = results_md.history_path(str(results), when)
    assert hist == str(tmp_path / "history" / "RESULTS-2026-12.md")
    results_md.append_history(hist, "## run 1\n")
    results_md.append_history(hist, "\n## run 2\n")
    text = open(hist, encoding="utf-8").read()
    assert text.startswith("# gradlink benchmark results: history 2026-12\n")
    assert text.endswith("\n## run 1\n\n## run 2\n")
