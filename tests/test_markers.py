"""The test tiers' markers: every marker a test under tests/ or benches/ uses is
registered, and pytest refuses one that is not, so a typo (`@pytest.mark.slwo`)
fails the run instead of leaving a test out of `-m "not slow"` or running it in
a tier it does not belong to."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
TIERS = {"slow", "model", "subprocess"}
# `pytest.mark.NAME` and `mark.NAME` (after `from pytest import mark`), in
# decorators and in `pytestmark = ...` alike.
MARK = re.compile(r"\bmark\.([A-Za-z_][A-Za-z0-9_]*)")


def _ini() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]


def _registered(pytestconfig: pytest.Config) -> set[str]:
    # Markers from pyproject.toml and every plugin's (pytest's own included:
    # parametrize, skipif, ...), as `pytest --markers` lists them.
    return {
        line.split(":", 1)[0].split("(", 1)[0].strip() for line in pytestconfig.getini("markers")
    }


def _used() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for folder in ("tests", "benches"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # its typos are on purpose
            for name in MARK.findall(path.read_text(encoding="utf-8")):
                used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return used


def test_strict_markers_is_on_for_every_run() -> None:
    assert "--strict-markers" in shlex.split(_ini()["addopts"])


def test_the_tiers_are_registered_with_what_they_mean() -> None:
    described = dict(line.split(":", 1) for line in _ini()["markers"])
    assert TIERS <= set(described)
    assert all(described[t].strip() for t in TIERS)


def test_every_marker_used_is_registered(pytestconfig: pytest.Config) -> None:
    used = _used()
    assert TIERS <= set(used), "each tier marks some test"
    unknown = {name: files for name, files in used.items() if name not in _registered(pytestconfig)}
    assert not unknown, f"markers not registered in pyproject.toml: {unknown}"


def test_an_unregistered_marker_fails_the_run(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\naddopts = --strict-markers\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.slwo\ndef test_typo():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_registered():\n    pass\n"
    )
    result = pytester.runpytest("-m", "not slow")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'slwo' not found in `markers` configuration option*"])


def test_each_test_marked_slow_from_conftest_is_still_a_test_of_its_file() -> None:
    """conftest.SLOW_ELSEWHERE marks tests of files it does not edit: a name that
    is no longer a test there (renamed, moved) would silently lose its mark."""
    # Read from the file: `import conftest` may find benches/conftest.py.
    source = ast.parse((ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    (table,) = [
        n.value
        for n in source.body
        if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "SLOW_ELSEWHERE"
    ]
    slow_elsewhere: dict[str, set[str]] = ast.literal_eval(table)
    for file, names in slow_elsewhere.items():
        tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
        tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        gone = {name for name in names if name.split("[", 1)[0] not in tests}
        assert not gone, f"not tests of tests/{file} (move their slow marks there): {gone}"
