"""The manual (docs/) builds as a site with `mkdocs build --strict`: a broken link,
a missing anchor or a page left out of the navigation fails the build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytestmark = pytest.mark.subprocess  # each test runs `mkdocs build`


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # Material prints a banner about its end of life on every build; not a warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_the_manual_builds_strictly(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    assert {Path(p).stem for p in pages - {"index.md"}} <= built, (pages, built)


@pytest.mark.parametrize(
    "breakage",
    ["a link to a page that is not there", "a page left out of the navigation"],
)
def test_a_broken_manual_fails_the_build(tmp_path, breakage):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    if breakage.startswith("a link"):
        page = copy / "docs" / "index.md"
        page.write_text(page.read_text() + "\n[gone](no-such-page.md)\n")
    else:
        (copy / "docs" / "orphan.md").write_text("# Orphan\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0, done.stdout + done.stderr
    assert ("no-such-page.md" if breakage.startswith("a link") else "orphan.md") in done.stderr
