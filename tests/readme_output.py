"""The documents' shown output (README.md and docs/), as patterns a real run must
match.

A `text` block that shows what a command prints matches that command's output
when each of its lines matches a line of the output, in order (the output may
have more lines: progress, more answers): figures may differ (any number matches
a number), runs of spaces may differ in width, and `...` stands for anything.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# README.md, then the manual's pages.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def text_block(first_line_prefix: str) -> str:
    """The documents' one `text` block whose first line starts so."""
    found = [body for doc in DOCUMENTS for kind, body in BLOCK.findall(doc.read_text())
             if kind == "text" and body.startswith(first_line_prefix)]  # fmt: skip
    assert len(found) == 1, f"{len(found)} text blocks start with {first_line_prefix!r}"
    return found[0]


def line_pattern(line: str, *, figures_vary: bool = True) -> re.Pattern[str]:
    """A README line as a regex: `...` anything, runs of spaces any width, and
    (where figures vary) any number for each number."""
    out = []
    for i, part in enumerate(line.strip().split("...")):
        if i:
            out.append(".*?")
        pos = 0
        for m in NUMBER.finditer(part) if figures_vary else ():
            out.append(_literal(part[pos : m.start()]))
            out.append(r"\d+(?:[.,]\d+)*")
            pos = m.end()
        out.append(_literal(part[pos:]))
    return re.compile("".join(out))


def _literal(text: str) -> str:
    return r"\s+".join(re.escape(w) for w in re.split(r" +", text))


def assert_shows(block: str, output: str) -> None:
    """Every line of `block`, in order, matches a line of `output`."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    at = 0
    for want in (ln for ln in block.splitlines() if ln.strip()):
        pattern = line_pattern(want)
        while at < len(lines) and not pattern.fullmatch(lines[at].strip()):
            at += 1
        assert at < len(lines), (
            f"the README shows {want!r}, which the output does not print (in that order):\n"
            + "\n".join(lines[-40:])
        )
        at += 1
