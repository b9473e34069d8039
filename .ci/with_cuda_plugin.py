"""Run `python ARGS...` with the JAX CUDA plugin's Python side importable there alone.

The plugin (its Python side, without CUDA's libraries) lets a test lower the
Triton kernel for cuda on a machine without a GPU. Installed into the user's
environment it would make every `import jax` warn about missing CUDA drivers, so
it goes into a temporary folder that is put in front of PYTHONPATH for one child
process. The child is this same interpreter, so it sees every package this one
sees, whether that is a virtualenv, a conda environment or a bare install. (A
throwaway venv made with --system-site-packages would not: from inside a venv it
sees the base interpreter's packages, not the venv's.)

    python .ci/with_cuda_plugin.py -m pytest tests/test_engine_attention.py -k cuda

Exit status: the child's; 0, saying so, when no plugin wheel for this jax can be
installed here (the lowering check is then skipped, as without a network).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def main(argv: list[str]) -> int:
    import jax

    spec = f"jax-cuda12-plugin=={jax.__version__}"
    with tempfile.TemporaryDirectory(prefix="kvsched-cuda-plugin-") as target:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-deps", "--target", target, spec]  # fmt: skip
        if subprocess.run(pip).returncode != 0:
            print(f"no {spec} wheel here: the Triton lowering check is skipped")
            return 0
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": target + (os.pathsep + path if path else "")}
        return subprocess.run([sys.executable, *argv], env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
