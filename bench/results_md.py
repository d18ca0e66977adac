"""bench/RESULTS.md: a short summary, updated in place; the full log in bench/history/.

The summary holds one section per benchmark tool between marker lines

    <!-- NAME:begin -->
    ...
    <!-- NAME:end -->

and a tool's next run replaces what is between its markers with its latest figures (nothing
outside them changes), while the run's full tables are appended to the month's history file,
bench/history/RESULTS-YYYY-MM.md (next to whatever --results names: DIR/history/STEM-YYYY-MM.md).
Used by bench/compare.py and bench/netcluster.py; replace_section() is the pure part
(tests/python/test_results_md.py).
"""

import datetime
import os
import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


def markers(name):
    """The begin and end marker lines (without their newline) of section `name`."""
    if not _NAME.match(name or ""):
        raise ValueError("bad section name %r (letters, digits, '_', '.', '-')" % (name,))
    return "<!-- %s:begin -->" % name, "<!-- %s:end -->" % name


def _marker_lines(text, marker):
    """(start, end) offsets of every line of text that is exactly `marker` (trailing blanks and
    a CR allowed), end excluding the newline."""
    return [(m.start(), m.end()) for m in
            re.finditer(r"^%s[ \t\r]*$" % re.escape(marker), text, re.MULTILINE)]


def replace_section(text, name, new_body):
    """text with the body of section `name` (the lines between its marker lines) replaced by
    new_body. Without the markers, the section is appended at the end after a blank line.
    Everything outside the body is kept byte for byte, the marker lines included. new_body gets
    a final newline if it lacks one ("" stays empty: the markers then enclose nothing).
    ValueError if the markers are unpaired, repeated or out of order, or new_body contains
    either marker line (the next replace would cut there)."""
    begin, end = markers(name)
    body = new_body if new_body == "" or new_body.endswith("\n") else new_body + "\n"
    if _marker_lines(body, begin) or _marker_lines(body, end):
        raise ValueError("the new body of section %r contains its own marker" % name)
    b, e = _marker_lines(text, begin), _marker_lines(text, end)
    if not b and not e:
        sep = "" if text == "" else ("\n" if text.endswith("\n") else "\n\n")
        return text + sep + begin + "\n" + body + end + "\n"
    if len(b) != 1 or len(e) != 1 or e[0][0] < b[0][1]:
        raise ValueError("section %r: expected one %s line and then one %s line; found %d and %d"
                         % (name, begin, end, len(b), len(e)))
    # The begin line ends with its newline (an end line follows it), kept as it was.
    return text[:b[0][1] + 1] + body + text[e[0][0]:]


def section_body(text, name):
    """The body of section `name` in text (between its marker lines), or None without them."""
    begin, end = markers(name)
    b, e = _marker_lines(text, begin), _marker_lines(text, end)
    if len(b) != 1 or len(e) != 1 or e[0][0] < b[0][1]:
        return None
    return text[b[0][1] + 1:e[0][0]]


def history_path(results_path, when=None):
    """Where the full tables of a run that updates results_path go: DIR/history/STEM-YYYY-MM.md
    (bench/RESULTS.md -> bench/history/RESULTS-2026-12.md), by the month of `when` (UTC; now)."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    d, base = os.path.split(os.path.abspath(results_path))
    stem = os.path.splitext(base)[0] or base
    return os.path.join(d, "history", "%s-%s.md" % (stem, when.strftime("%Y-%m")))


def update_section(path, name, body):
    """Replaces section `name` of the file at path (created if missing); the file is rewritten
    through a temporary file and a rename, so a reader never sees half of it."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    new = replace_section(text, name, body)
    if new == text:
        return
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(new)
    os.replace(tmp, path)


def append_history(path, text, results_name="RESULTS.md"):
    """Appends text to the history file at path, creating it (and its directory) with a heading
    first. Returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", encoding="utf-8") as f:
        if new:
            month = os.path.splitext(os.path.basename(path))[0].rsplit("-", 2)
            when = "-".join(month[1:]) if len(month) == 3 else ""
            f.write("# gradlink benchmark results: history%s\n\n"
                    "Every run's full tables, appended by the tools in the order they ran; the "
                    "latest of each is summarized in ../%s.\n" % (
                        " " + when if when else "", results_name))
        f.write(text if text.startswith("\n") else "\n" + text)
        if not text.endswith("\n"):
            f.write("\n")
    return path
