"""The code blocks of README.md and of every page of docs/ run as written, and
print what they show.

Python blocks run in order, one namespace a page (as a reader pastes a page's
blocks into one session); a comment after a `print(...)` is what it prints (`<...>` a figure
that varies, `e.g.` an illustration of a branch not taken), checked against
what the block printed, and a bare expression with such a comment (which would
print nothing in a script) is refused. `text` blocks that show a command's
output match a real run of it (tests/readme_output.py; the main job's in
tests/test_examples.py). Bash blocks: every `kvsched ...` command runs (through `python -m
kvsched`, in a scratch directory), every `python examples/...` command too (from the
repository root); the install, test and example commands are
what `.ci/run` and tests/test_examples.py run themselves, so they are checked
to be exactly those.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from readme_output import DOCUMENTS, assert_shows, text_block

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
# Commands .ci/run or the example tests already run; anything else in a bash
# block must be a `kvsched` command.
COVERED = (
    'pip install -e ".[engine]" && python examples/engine.py',
    "bash .ci/run",
    'pip install -e ".[test]"',
    'pip install -e ".[engine,serve]"',
    "cargo test",
    "python -m pytest",
    "python -m mypy.stubtest kvsched._core",
    "python -m mypy --strict examples/",  # tests/test_stub.py runs it
    "KVSCHED_HYPOTHESIS=long python -m pytest",
    # The device checks: tests/test_check_scripts.py and test_examples.py run
    # them in the interpreter (--small) and check that, with no device and no
    # --small, they say so and exit 2 (their run on a device is the point).
    "python benches/tpu_check.py",
    "python benches/gpu_check.py",
)


def blocks(lang: str, doc: Path | None = None) -> list[str]:
    """The `lang` blocks of one document, or of all of them (README first)."""
    docs = DOCUMENTS if doc is None else [doc]
    return [body for d in docs for kind, body in BLOCK.findall(d.read_text()) if kind == lang]


def commands(body: str) -> list[str]:
    """Logical lines (continuations joined), comments dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def shown_prints(body: str) -> list[re.Pattern[str]]:
    """What the block's prints show, as patterns, in order; a bare expression
    whose comment shows an output is an error (a script prints nothing)."""
    comments = {
        tok.start[0]: tok.string[1:].strip()
        for tok in tokenize.generate_tokens(io.StringIO(body).readline)
        if tok.type == tokenize.COMMENT
    }
    shown = []
    for node in ast.walk(ast.parse(body)):
        if not isinstance(node, ast.Expr) or node.end_lineno not in comments:
            continue
        comment = comments[node.end_lineno]
        call = node.value
        is_print = (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "print")  # fmt: skip
        assert is_print, (
            f"line {node.lineno}: {ast.unparse(node)!r} shows {comment!r} but prints nothing"
        )
        if not comment.startswith("e.g."):
            shown.append((node.lineno, comment))
    return [_shown_pattern(c) for _, c in sorted(shown)]


def _shown_pattern(comment: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in re.finditer(r"<[^>]*>|\.\.\.", comment):
        out.append(re.escape(comment[pos : m.start()]))
        out.append(".+?")
        pos = m.end()
    out.append(re.escape(comment[pos:]))
    return re.compile("".join(out))


def test_shown_prints_reads_comments_and_refuses_bare_expressions():
    pats = shown_prints('x = 1  # not shown\nprint(x, 2)  # 1 2\nprint("a")  # e.g. b\n')
    assert [p.pattern for p in pats] == ["1\\ 2"]
    assert _shown_pattern("max rate: <m>x = ... req/s").fullmatch("max rate: 0.5x = 3 req/s")
    with pytest.raises(AssertionError, match="prints nothing"):
        shown_prints("stats = {}\nstats  # pool, tenants\n")


def test_the_documents_have_python_and_bash_blocks():
    assert README in DOCUMENTS and len(DOCUMENTS) >= 8, DOCUMENTS
    assert len(blocks("python")) >= 4 and len(blocks("bash")) >= 5
    assert blocks("python", README) and blocks("bash", README)


def _python_pages() -> list:
    """The pages with Python blocks; one that calls the server is slow, starts a
    process and needs the real model."""
    pages = []
    for doc in DOCUMENTS:
        if not blocks("python", doc):
            continue
        serves = any("127.0.0.1:8000" in b for b in blocks("python", doc))
        marks = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.model] if serves else []
        pages.append(pytest.param(doc, id=doc.name, marks=marks))
    return pages


@pytest.mark.parametrize("doc", _python_pages())
def test_python_blocks_run_as_written(doc, tmp_path, monkeypatch):
    """Blocks that call the server (`OpenAI(base_url=...:8000)`) run against a
    `kvsched serve` started here with the page's tenants file, on a free port
    written in place of 8000."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    server = None
    try:
        for body in blocks("python", doc):
            if "127.0.0.1:8000" in body:
                if server is None:
                    server, url = start_readme_server(tmp_path, doc)
                body = body.replace("http://127.0.0.1:8000", url)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(body, str(doc), "exec"), namespace)  # noqa: S102
            out = printed.getvalue()
            lines = iter(out.splitlines())  # each shown output is a whole line, in order
            for shown in shown_prints(body):
                assert any(shown.fullmatch(line) for line in lines), (
                    f"{doc.name} shows {shown.pattern!r}; the block printed:\n{out}"
                )
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


def start_readme_server(tmp_path, doc):
    """`kvsched serve` over the real model with the page's tenants file."""
    for name in ("fastapi", "uvicorn", "openai", "gguf"):
        pytest.importorskip(name)
    from serve_helpers import start_serve
    from smollm2_helpers import smollm2_file

    smollm2_file()  # skips with the reason when the model cannot be fetched
    (toml,) = blocks("toml", doc)
    (tmp_path / "tenants.toml").write_text(toml)
    return start_serve(
        ["--tenants", str(tmp_path / "tenants.toml"), "--max-seq-len", "256"],
        cwd=tmp_path,
        timeout=300,
    )


TEXT_BLOCKS = {
    "submit ": "the route map, not output",
    "loaded SmolLM2": "tests/test_examples.py runs the main job and checks it",
    "int8 KV vs float32 KV": "test_the_eval_kv_output_is_what_kvsched_eval_kv_prints",
}


def test_every_text_block_is_the_route_map_or_checked_output():
    for body in blocks("text"):
        assert body.startswith(tuple(TEXT_BLOCKS)), f"a text block no test checks: {body[:80]!r}"


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.model
def test_the_eval_kv_output_is_what_kvsched_eval_kv_prints(tmp_path):
    """`kvsched eval-kv` (one prompt, a few tokens: the same lines) in a home of
    its own, so its report lands there and its path reads as the README's."""
    for name in ("jax", "gguf"):
        pytest.importorskip(name)
    from kvsched import model_files

    from smollm2_helpers import smollm2_file

    smollm2_file()  # skips with the reason when the model cannot be fetched
    cache = tmp_path / ".cache" / "kvsched"
    cache.mkdir(parents=True)
    (cache / model_files.SMOLLM2_135M.name).symlink_to(model_files.fetch(quiet=True))
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCHED_CACHE", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-m", "kvsched", "eval-kv", "--prompts", "1",
                           "--tokens", "4"], capture_output=True, text=True, timeout=600,
                          env={**env, "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert_shows(text_block("int8 KV vs float32 KV"), done.stdout.replace(str(tmp_path), "~"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_bash_blocks_are_covered_or_run(tmp_path):
    pytest.importorskip("matplotlib")
    ran = 0
    for body in blocks("bash"):
        for cmd in commands(body):
            if cmd.startswith(COVERED):
                continue
            args = shlex.split(cmd)
            # Examples, and the benchmark scripts a page shows in a bash block
            # (the device checks above are covered elsewhere).
            if args[0] == "python" and args[1].startswith(("examples/", "benches/")):
                argv, cwd = [sys.executable, *args[1:]], README.parent
            else:
                assert args[0] == "kvsched", f"a README command no test runs: {cmd!r}"
                argv, cwd = [sys.executable, "-m", "kvsched", *args[1:]], tmp_path
            done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            ran += 1
    assert ran >= 4
