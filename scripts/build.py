#!/usr/bin/env python
"""Build hub kernel repos: the command line of `hubfuse.build` (this clone's, installed or not).

    python scripts/build.py                 # the umbrella `hubfuse` and every kernel_repos/*
    python scripts/build.py rmsnorm rotary  # selected repos (kernel names; `hubfuse` = the umbrella)
    python scripts/build.py --no-verify     # skip the load and layer-rule checks
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))

from hubfuse.build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
