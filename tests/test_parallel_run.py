""".ci/run's pytest runs two workers (pytest-xdist). tests/conftest.py makes that
safe for the tests that time the machine: a test marked `alone` runs while the
other worker runs nothing, and last; the slow tests are handed out first. Checked on a
small suite of sleeping tests that record when they ran, run as .ci/run runs
pytest, with tests/conftest.py's hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist", reason="the parallel run needs pytest-xdist (the test extra)")

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("kvsched_conftest", {str(TESTS / "conftest.py")!r})
ours = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ours)
pytest_collection_modifyitems = ours.pytest_collection_modifyitems
pytest_runtest_protocol = ours.pytest_runtest_protocol
"""

RECORD = """
import json, os, time
import pytest

def record(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["RUNS"], "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")
"""

# Collected first (file order): ten quick tests.
QUICK = """
@pytest.mark.parametrize("i", range(10))
def test_quick(i):
    record(f"quick{i}", 0.15)
"""

# Collected last: the slow ones.
SLOW = """
@pytest.mark.slow
@pytest.mark.alone
def test_times_the_machine():
    record("alone", 1.0)

@pytest.mark.slow
def test_long():
    record("long", 0.6)
"""


def test_an_alone_test_runs_with_no_other_beside_it_and_last_and_slow_tests_first(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_a_quick.py").write_text(RECORD + QUICK)
    (tmp_path / "test_b_slow.py").write_text(RECORD + SLOW)
    runs = tmp_path / "runs.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "load", "--maxschedchunk", "1", "-W", "ignore::pytest.PytestUnknownMarkWarning",
         "--basetemp", str(tmp_path / "base"), "test_a_quick.py", "test_b_slow.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "RUNS": str(runs)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in runs.read_text().splitlines()]
    assert len(rows) == 12
    when = {name: (start, end) for name, start, end in rows}
    a0, a1 = when["alone"]
    beside = [n for n, (s, e) in when.items() if n != "alone" and s < a1 and e > a0]
    assert beside == [], f"ran beside the alone test: {beside}"
    # The slow test was handed out first (in file order six or more quick ones
    # would have started before it), the alone one last (waiting for the other
    # worker's quick test, not its slow one): at most two quick ones were still
    # queued when it started.
    quick = [s for n, (s, _) in when.items() if n.startswith("quick")]
    assert sum(s < when["long"][0] for s in quick) <= 3
    assert sum(s < a0 for s in quick) >= 8
