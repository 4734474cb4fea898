"""Kernel tests import the assembled op packages (source + vendored shared modules, `scripts/build.py --stage`),
re-assembled at the start of every test session so that they always test the current source."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))
sys.path.insert(0, str(build.stage()))
