"""hubfuse/build.py (scripts/build.py): variants, metadata, unique ids and namespaces, relative imports, clear failures."""
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hubfuse import build as build_tool
from tests.utils import ROOT, build, repo_dir


def test_build_writes_every_backend_with_unique_ids():
    build("rmsnorm")
    variants = sorted((ROOT / "kernel_repos/rmsnorm/build").glob("torch-*"))
    assert [v.name for v in variants] == ["torch-cpu", "torch-cuda", "torch-rocm", "torch-xpu"]
    ids = set()
    for v in variants:
        meta = json.loads((v / "metadata.json").read_text())
        assert meta["name"] == "rmsnorm" and meta["version"] == 1 and meta["python-depends"] == []
        assert meta["backend"]["type"] == v.name.removeprefix("torch-")
        assert meta["id"].isidentifier() and meta["id"] in (v / "_common/_ops.py").read_text()
        assert set(meta["digest"]["files"]) >= {"__init__.py", "ops.py", "_common/_ops.py"}
        assert not list(v.rglob("__pycache__"))
        ids.add(meta["id"])
    assert len(ids) == 4


@pytest.mark.parametrize("name", sorted(build_tool.discover_repos()))
def test_kernels_info_passes_on_every_build(name):
    """`kernels info <repo>` (the hub CLI) reads every build: name, version and all four backends."""
    build(name)
    cli = "import sys; from kernels.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", cli, "info", str(repo_dir(name)), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["name"] == name and info["version"] == 1 and info["python_depends"] == []
    assert sorted(info["backends"]) == ["cpu", "cuda", "rocm", "xpu"]


def test_digest_matches_kernels_hash():
    from kernels._rust import Digest, DigestAlgorithm

    build("rmsnorm")
    v = ROOT / "kernel_repos/rmsnorm/build/torch-cpu"
    meta = json.loads((v / "metadata.json").read_text())
    digest = Digest.hash_variant(DigestAlgorithm.SHA256, str(v))
    assert set(meta["digest"]["files"]) == set(digest.files)


def test_umbrella_nests_op_packages_under_its_own_namespace():
    build("hubfuse")
    v = ROOT / "build/torch-cuda"
    meta = json.loads((v / "metadata.json").read_text())
    for family in build_tool.families():
        pkg = v / build_tool.package_name(family)
        assert (pkg / "ops.py").is_file() and not pkg.is_symlink() and not (pkg / "_common").exists()
    assert f'"{meta["id"]}::"' in (v / "_common/_ops.py").read_text()
    assert not (v / "build.py").exists()  # the build tool does not ship


def test_source_hash_changes_with_source(tmp_path):
    src = tmp_path / "pkg"
    shutil.copytree(ROOT / "kernel_repos/rmsnorm/torch-ext/rmsnorm", src,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = build_tool.source_hash(src)
    (src / "ops.py").write_text((src / "ops.py").read_text() + "\n# edit\n")
    assert build_tool.source_hash(src) != before


def _copy_repo(tmp_path):
    repo = tmp_path / "rmsnorm"
    shutil.copytree(ROOT / "kernel_repos/rmsnorm", repo, ignore=shutil.ignore_patterns("build", "__pycache__"))
    return repo


def test_rejects_unknown_build_toml_key(tmp_path):
    repo = _copy_repo(tmp_path)
    (repo / "build.toml").write_text((repo / "build.toml").read_text().replace("[torch-noarch]",
                                                                               "[torch-noarch]\nuniversal = true"))
    with pytest.raises(build_tool.BuildError, match="rejected by the kernels parser"):
        build_tool.build_repo(repo)


def test_rejects_card_layer_that_does_not_exist(tmp_path):
    repo = _copy_repo(tmp_path)
    card = repo / "CARD.md"
    card.write_text(card.read_text().replace("## Layers\n", "## Layers\n\n- `NoSuchNorm`: missing\n"))
    with pytest.raises(build_tool.BuildError, match="NoSuchNorm"):
        build_tool.build_repo(repo)


def test_rejects_layer_breaking_kernels_rules(tmp_path):
    repo = _copy_repo(tmp_path)
    layers = repo / "torch-ext/rmsnorm/layers.py"
    layers.write_text(layers.read_text().replace(
        "    has_backward = True\n    can_torch_compile = True\n\n    def forward(self, hidden_states: torch.Tensor)",
        "    has_backward = True\n    can_torch_compile = True\n    scale = 2.0\n\n    def forward(self, hidden_states: torch.Tensor)", 1))
    with pytest.raises(build_tool.BuildError, match="layer rules"):
        build_tool.build_repo(repo)


def test_cli_exit_codes():
    ok = subprocess.run([sys.executable, "scripts/build.py", "rmsnorm"], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "scripts/build.py", "nope"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown kernel repo" in bad.stderr


def test_shared_package_is_vendored_into_every_variant():
    """One source of the shared code (hubfuse._common), copied into every variant once; the op packages a
    package imports (rmsnorm for rotary) are vendored beside it, and every `hubfuse` import is relative."""
    build("rotary", "hubfuse")
    shared = ROOT / "torch-ext/hubfuse/_common"
    for variant in (ROOT / "kernel_repos/rotary/build/torch-cuda", ROOT / "build/torch-cpu"):
        for p in shared.glob("*.py"):
            if p.name != "_ops.py":  # generated per variant
                assert (variant / "_common" / p.name).read_bytes() == p.read_bytes(), variant / p.name
        assert (variant / "rmsnorm/layers.py").is_file()
        for p in variant.rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                assert not [n for n in names if n.split(".")[0] == "hubfuse"], (p, node.lineno)
    rotary = ROOT / "kernel_repos/rotary/build/torch-cuda"
    assert "from .rmsnorm.layers import" in (rotary / "layers.py").read_text()
    assert "from .._common.custom_op import" in (rotary / "rmsnorm/ops.py").read_text()
    assert sorted(p.name for p in rotary.iterdir() if p.is_dir()) == ["_common", "rmsnorm"]


def _package(tmp_path, files: dict[str, str]):
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_rewrite_imports_makes_every_form_relative(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from hubfuse.rotary import ops\nimport os.path, hubfuse.rmsnorm.ops as rms_ops\n",
        "ops.py": "from hubfuse._common.launch import (\n    cdiv,\n    launch as run,\n)\nx = 'import hubfuse'\n",
        "rmsnorm/layers.py": "def f():\n    from hubfuse.rmsnorm import ops, reference\n    from hubfuse import _common\n",
    })
    build_tool.rewrite_imports(pkg, {"hubfuse.rotary": (), "hubfuse.rmsnorm": ("rmsnorm",),
                                     "hubfuse._common": ("_common",)})
    assert (pkg / "__init__.py").read_text() == "from . import ops\nimport os.path; from .rmsnorm import ops as rms_ops\n"
    assert (pkg / "ops.py").read_text() == "from ._common.launch import cdiv, launch as run\nx = 'import hubfuse'\n"
    assert (pkg / "rmsnorm/layers.py").read_text() == ("def f():\n    from ..rmsnorm import ops, reference\n"
                                                       "    from .. import _common\n")


@pytest.mark.parametrize("source, message", [
    ("import hubfuse.rmsnorm\n", "cannot become a relative import"),
    ("from hubfuse.kernel_config import KernelConfig\n", "does not carry"),
])
def test_rewrite_imports_rejects_what_it_cannot_express(tmp_path, source, message):
    pkg = _package(tmp_path, {"__init__.py": "", "ops.py": source})
    with pytest.raises(build_tool.BuildError, match=f"ops.py:1: .*{message}"):
        build_tool.rewrite_imports(pkg, {"hubfuse.rotary": (), "hubfuse.rmsnorm": ("rmsnorm",)})


def test_rejects_op_package_importing_beyond_op_packages(tmp_path):
    repo = _copy_repo(tmp_path)
    ops = repo / "torch-ext/rmsnorm/ops.py"
    ops.write_text("from hubfuse.presets import kernel_mapping\n" + ops.read_text())
    with pytest.raises(build_tool.BuildError, match="imports hubfuse.presets"):
        build_tool.build_repo(repo)


def test_tree_has_no_symlinks():
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True).stdout
    assert not [line for line in tracked.splitlines() if line.startswith("120000")]


def test_rejects_package_dir_clashing_with_a_vendored_package(tmp_path):
    repo = _copy_repo(tmp_path)
    (repo / "torch-ext/rmsnorm/_common").mkdir()
    (repo / "torch-ext/rmsnorm/_common/__init__.py").write_text("")
    with pytest.raises(build_tool.BuildError, match="clashes with the vendored package hubfuse._common"):
        build_tool.build_repo(repo)


_SELF_CONTAINED = """
import site
import sys
from pathlib import Path
root, variant = Path(sys.argv[1]), Path(sys.argv[2])
# The interpreter's own environment (a venv may live inside the clone) stays; the source tree goes.
environment = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *site.getsitepackages(),
                                           site.getusersitepackages())]


def in_source_tree(path):
    path = Path(path).resolve()
    return path.is_relative_to(root) and not any(path.is_relative_to(env) for env in environment)


sys.path[:] = [p for p in sys.path if p and not in_source_tree(p)]
before = set(sys.modules)
import kernels
module = kernels.get_local_kernel(variant)
assert hasattr(module, "layers"), "no layers"
for name in set(sys.modules) - before:
    path = getattr(sys.modules[name], "__file__", None) or ""
    if path and in_source_tree(path):
        assert Path(path).resolve().is_relative_to(variant.resolve()), (name, path)
assert not [n for n in sys.modules if n.split(".")[0] == "hubfuse"], "imported the source package"
print("ok", module.__name__)
"""


def _import_on_its_own(variant, root, cwd):
    proc = subprocess.run([sys.executable, "-c", _SELF_CONTAINED, str(root), str(variant)], cwd=cwd,
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                               if k != "PYTHONPATH"})
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (variant, proc.stderr[-2000:])


@pytest.mark.parametrize("name", sorted(build_tool.discover_repos()))
def test_every_built_variant_imports_on_its_own(name, tmp_path):
    """Each variant loads by itself: no parent package, the source tree off sys.path, and every module it
    imports from this repository comes from inside the variant."""
    build(name)
    for variant in sorted((repo_dir(name) / "build").glob("torch-*")):
        _import_on_its_own(variant, ROOT, tmp_path)


def test_variant_import_check_keeps_an_environment_inside_the_clone(tmp_path):
    """A venv inside the clone (`python -m venv .venv`) holds torch and kernels: the check strips the source
    tree from sys.path, not the interpreter's site-packages. Simulated by a clone root that contains this
    interpreter's prefix."""
    build("rmsnorm")
    _import_on_its_own(repo_dir("rmsnorm") / "build/torch-cpu", Path(sys.prefix).resolve().parent, tmp_path)
