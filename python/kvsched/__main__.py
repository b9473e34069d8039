"""`python -m kvsched`: the kvsched command."""

import sys

from kvsched.cli import main

if __name__ == "__main__":  # not when a spawned process (the engine's) imports it
    sys.exit(main())
