"""pyproject.toml's requires-python admits no interpreter that cannot import the package and scripts."""
import re
import tomllib

from packaging.specifiers import SpecifierSet

from tests.utils import ROOT

# standard-library modules newer than the oldest Python 3 release line: the first version that has them
_NEW_STDLIB = {"tomllib": "3.11"}


def test_requires_python_matches_the_standard_library_in_use():
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    sources = [*ROOT.glob("scripts/*.py"), *ROOT.glob("torch-ext/**/*.py"),
               *ROOT.glob("kernel_repos/*/torch-ext/**/*.py")]
    for module, first in _NEW_STDLIB.items():
        users = [p.relative_to(ROOT) for p in sources
                 if re.search(rf"^\s*(import|from) {module}\b", p.read_text(), re.M)]
        major, minor = map(int, first.split("."))
        assert not users or not spec.contains(f"{major}.{minor - 1}"), \
            f"{users} import {module} (Python >= {first}); requires-python {spec}"
