"""scripts/push.py against a mocked HfApi (no hub, no network)."""

import importlib.util
import json
import sys
import types
from pathlib import Path
from unittest import mock

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete
from huggingface_hub.errors import HfHubHTTPError

_PUSH_PY = Path(__file__).resolve().parent.parent / "scripts" / "push.py"
_spec = importlib.util.spec_from_file_location("hubfuse_push", _PUSH_PY)
push = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = push  # dataclasses look the module up while the class is built
_spec.loader.exec_module(push)

WRITE_METHODS = ["create_repo", "create_branch", "create_commit", "upload_file", "delete_file",
                 "upload_folder", "delete_folder", "delete_repo", "create_tag", "delete_branch"]

EXPECTED_ADDS = [
    "benchmarks/benchmark_x.py",
    "build/torch-cpu/__init__.py",
    "build/torch-cpu/metadata.json",
    "build/torch-cuda/__init__.py",
    "build/torch-cuda/metadata.json",
]


def make_kernel_repo(repo_dir: Path, name="rmsnorm", version=1, org="hubfuse",
                     variant_versions=None) -> Path:
    """A built kernel repo as scripts/build.py leaves it."""
    variant_versions = variant_versions or {}
    repo_dir.mkdir(parents=True, exist_ok=True)
    (repo_dir / "build.toml").write_text(
        f'[general]\nname = "{name}"\nversion = {version}\nedition = 5\n'
        f'backends = ["cpu", "cuda"]\n\n[general.hub]\nrepo-id = "{org}/{name}"\n'
    )
    (repo_dir / "CARD.md").write_text(f"# {name}\n")
    for backend in ("cpu", "cuda"):
        vdir = repo_dir / "build" / f"torch-{backend}"
        (vdir / "__pycache__").mkdir(parents=True)
        meta = {"name": name, "id": f"_{name}_{backend}_abc1234",
                "version": variant_versions.get(backend, version), "license": "apache-2.0",
                "python-depends": [], "backend": {"type": backend}}
        (vdir / "metadata.json").write_text(json.dumps(meta))
        (vdir / "__init__.py").write_text("from . import layers\n")
        (vdir / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0")
        (vdir / "stray.pyc").write_bytes(b"\0")
    (repo_dir / "benchmarks").mkdir()
    (repo_dir / "benchmarks" / "benchmark_x.py").write_text("# benchmark\n")
    (repo_dir / "benchmarks" / "helper.py").write_text("# not a benchmark*.py\n")
    (repo_dir / "torch-ext").mkdir()  # sources are not uploaded
    (repo_dir / "torch-ext" / "src.py").write_text("")
    return repo_dir


def make_api(branches=("main",), files=()):
    api = mock.create_autospec(huggingface_hub.HfApi, instance=True)
    api.list_repo_refs.return_value = huggingface_hub.GitRefs(
        branches=[huggingface_hub.GitRefInfo(name=b, ref=f"refs/heads/{b}", target_commit="0" * 40)
                  for b in branches],
        converts=[], tags=[])
    api.list_repo_files.return_value = list(files)
    return api


def http_error(status: int) -> HfHubHTTPError:
    # HfHubHTTPError(message, *, response): reads response.headers and response.request.
    response = types.SimpleNamespace(status_code=status, headers={}, request=None)
    return HfHubHTTPError(f"{status} Client Error", response=response)


@pytest.fixture
def checkout(tmp_path):
    """A checkout with the umbrella repo at the root and one kernel repo."""
    make_kernel_repo(tmp_path, name="hubfuse")
    make_kernel_repo(tmp_path / "kernel_repos" / "rmsnorm", name="rmsnorm")
    return tmp_path


@pytest.fixture
def patched(monkeypatch):
    """push.main with a token and a mocked HfApi; returns the mock."""
    api = make_api()
    monkeypatch.setattr(push, "get_token", lambda: "hf_fake")
    monkeypatch.setattr(push, "HfApi", lambda token=None: api)
    return api


def assert_no_writes(api):
    for m in WRITE_METHODS:
        assert not getattr(api, m).called, m


# --- plan -------------------------------------------------------------------------------------

def test_plan_upload_files_and_org(tmp_path):
    repo = make_kernel_repo(tmp_path / "rmsnorm")
    plan = push.plan_upload(repo)
    assert plan.repo_id == "hubfuse/rmsnorm" and plan.branch == "v1"
    assert plan.variants == ("torch-cpu", "torch-cuda")
    assert [p for p, _ in plan.files] == EXPECTED_ADDS
    assert all(local == repo / p for p, local in plan.files)
    assert push.plan_upload(repo, org="my-org").repo_id == "my-org/rmsnorm"


def test_stale_files_only_under_managed_prefixes(tmp_path):
    plan = push.plan_upload(make_kernel_repo(tmp_path / "rmsnorm"))
    existing = EXPECTED_ADDS + ["README.md", ".gitattributes", "build/torch-cpu/old.py",
                                "benchmarks/benchmark_old.py", "build/torch-rocm/__init__.py"]
    assert push.stale_files(plan, existing) == ["benchmarks/benchmark_old.py", "build/torch-cpu/old.py"]


# --- execute ----------------------------------------------------------------------------------

def test_execute_exact_calls_new_branch(tmp_path):
    repo = make_kernel_repo(tmp_path / "rmsnorm")
    plan = push.plan_upload(repo, org="my-org")
    api = make_api(branches=("main",))
    push.execute(plan, api)

    api.create_repo.assert_called_once_with("my-org/rmsnorm", repo_type="kernel", exist_ok=True, private=None)
    api.list_repo_refs.assert_called_once_with("my-org/rmsnorm", repo_type="kernel")
    api.create_branch.assert_called_once_with("my-org/rmsnorm", branch="v1", repo_type="kernel", exist_ok=True)
    api.list_repo_files.assert_not_called()  # a new branch has no stale files

    api.create_commit.assert_called_once()
    args, kwargs = api.create_commit.call_args
    assert args == ("my-org/rmsnorm",)
    assert kwargs["revision"] == "v1" and kwargs["repo_type"] == "kernel" and kwargs["create_pr"] is False
    ops = kwargs["operations"]
    assert all(isinstance(op, CommitOperationAdd) for op in ops)
    assert [op.path_in_repo for op in ops] == EXPECTED_ADDS
    assert [op.path_or_fileobj for op in ops] == [str(repo / p) for p in EXPECTED_ADDS]

    api.upload_file.assert_called_once()
    kw = api.upload_file.call_args.kwargs
    assert (kw["path_or_fileobj"], kw["path_in_repo"], kw["repo_id"], kw["repo_type"], kw["revision"],
            kw["create_pr"]) == (str(repo / "CARD.md"), "README.md", "my-org/rmsnorm", "kernel", "main", False)


def test_execute_existing_branch_deletes_stale(tmp_path):
    plan = push.plan_upload(make_kernel_repo(tmp_path / "rmsnorm"))
    api = make_api(branches=("main", "v1"),
                   files=["README.md", "build/torch-cpu/__init__.py", "build/torch-cpu/old_kernel.py"])
    push.execute(plan, api, create_pr=True, private=True)

    api.create_repo.assert_called_once_with("hubfuse/rmsnorm", repo_type="kernel", exist_ok=True, private=True)
    api.create_branch.assert_not_called()
    api.list_repo_files.assert_called_once_with("hubfuse/rmsnorm", revision="v1", repo_type="kernel")
    kwargs = api.create_commit.call_args.kwargs
    assert kwargs["create_pr"] is True
    deletes = [op for op in kwargs["operations"] if isinstance(op, CommitOperationDelete)]
    assert [op.path_in_repo for op in deletes] == ["build/torch-cpu/old_kernel.py"]
    assert api.upload_file.call_args.kwargs["create_pr"] is True


# --- CLI --------------------------------------------------------------------------------------

def test_dry_run_lists_operations_and_writes_nothing(checkout, patched, capsys):
    patched.list_repo_refs.return_value.branches.append(
        huggingface_hub.GitRefInfo(name="v1", ref="refs/heads/v1", target_commit="1" * 40))
    patched.list_repo_files.return_value = ["build/torch-cpu/__init__.py", "build/torch-cuda/gone.py"]
    rc = push.main(["--root", str(checkout), "--org", "my-org", "--repo", "rmsnorm", "--dry-run"])
    assert rc == 0
    ops = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
    assert ops == (
        ["create_repo my-org/rmsnorm (kernel)"]
        + [f"add {p} -> my-org/rmsnorm@v1" for p in EXPECTED_ADDS]
        + ["delete build/torch-cuda/gone.py -> my-org/rmsnorm@v1",
           "upload CARD.md -> my-org/rmsnorm@main:README.md"]
    )
    assert_no_writes(patched)


def test_dry_run_new_branch_all_repos(checkout, patched, capsys):
    assert push.main(["--root", str(checkout), "--dry-run", "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "create_branch hubfuse/hubfuse v1" in out
    assert "create_branch hubfuse/rmsnorm v1" in out
    assert "add build/torch-cpu/__init__.py -> hubfuse/rmsnorm@v1" in out
    adds = [l for l in out if l.startswith("add ")]
    assert len(adds) == 2 * len(EXPECTED_ADDS)
    assert not any("kernel_repos/" in l or "torch-ext" in l or "pycache" in l or ".pyc" in l for l in adds)
    assert_no_writes(patched)


def test_dry_run_without_token(checkout, monkeypatch, capsys):
    monkeypatch.setattr(push, "get_token", lambda: None)
    monkeypatch.setattr(push, "HfApi", mock.Mock(side_effect=AssertionError("no api without token")))
    assert push.main(["--root", str(checkout), "--repo", "rmsnorm", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [l for l in out if l.startswith("add ")] == [f"add {p} -> hubfuse/rmsnorm@v1" for p in EXPECTED_ADDS]
    assert sum("deletes unknown" in l for l in out) == 1
    assert not any(l.startswith("delete ") for l in out)


def test_real_push_calls(checkout, patched, capsys):
    rc = push.main(["--root", str(checkout), "--org", "my-org", "--repo", "rmsnorm", "--create-pr"])
    assert rc == 0
    patched.create_repo.assert_called_once_with("my-org/rmsnorm", repo_type="kernel", exist_ok=True, private=None)
    patched.create_branch.assert_called_once_with("my-org/rmsnorm", branch="v1", repo_type="kernel", exist_ok=True)
    assert patched.create_commit.call_args.kwargs["create_pr"] is True
    assert patched.create_commit.call_args.kwargs["revision"] == "v1"
    assert patched.upload_file.call_args.kwargs["create_pr"] is True
    assert patched.upload_file.call_args.kwargs["revision"] == "main"


def test_default_pushes_every_repo(checkout, patched):
    assert push.main(["--root", str(checkout)]) == 0
    assert [c.args[0] for c in patched.create_repo.call_args_list] == ["hubfuse/hubfuse", "hubfuse/rmsnorm"]
    assert patched.create_commit.call_count == 2


def test_unknown_repo_name(checkout, patched, capsys):
    assert push.main(["--root", str(checkout), "--repo", "nope", "--dry-run"]) != 0
    err = capsys.readouterr().err
    assert "nope" in err and "hubfuse" in err and "rmsnorm" in err
    assert_no_writes(patched)


def test_version_mismatch_between_variants(tmp_path, patched, capsys):
    make_kernel_repo(tmp_path / "kernel_repos" / "rmsnorm", variant_versions={"cuda": 2})
    assert push.main(["--root", str(tmp_path), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "version mismatch" in err and "torch-cuda=2" in err and "Traceback" not in err
    assert_no_writes(patched)


def test_version_mismatch_with_build_toml(tmp_path, patched, capsys):
    make_kernel_repo(tmp_path / "kernel_repos" / "rmsnorm", version=2, variant_versions={"cpu": 1, "cuda": 1})
    assert push.main(["--root", str(tmp_path)]) == 1
    assert "build.toml has version=2" in capsys.readouterr().err
    assert_no_writes(patched)


def test_missing_build(tmp_path, patched, capsys):
    import shutil
    repo = make_kernel_repo(tmp_path / "kernel_repos" / "rmsnorm")
    shutil.rmtree(repo / "build")
    assert push.main(["--root", str(tmp_path), "--dry-run"]) == 1
    assert "python scripts/build.py" in capsys.readouterr().err
    assert_no_writes(patched)


def test_missing_card(tmp_path, patched, capsys):
    repo = make_kernel_repo(tmp_path / "kernel_repos" / "rmsnorm")
    (repo / "CARD.md").unlink()
    assert push.main(["--root", str(tmp_path)]) == 1
    assert "CARD.md" in capsys.readouterr().err
    assert_no_writes(patched)


def test_missing_token(checkout, monkeypatch, capsys):
    monkeypatch.setattr(push, "get_token", lambda: None)
    monkeypatch.setattr(push, "HfApi", mock.Mock(side_effect=AssertionError("no api without token")))
    assert push.main(["--root", str(checkout)]) == 1
    err = capsys.readouterr().err
    assert "hf auth login" in err and "HF_TOKEN" in err


@pytest.mark.parametrize("status", [401, 403])
def test_forbidden_is_a_clear_message(checkout, patched, capsys, status):
    patched.create_repo.side_effect = http_error(status)
    assert push.main(["--root", str(checkout), "--org", "other-org", "--repo", "rmsnorm"]) == 1
    err = capsys.readouterr().err
    assert f"HTTP {status}" in err and "no permission" in err and "'other-org'" in err
    assert "kernel-creation access" in err and "Traceback" not in err
    patched.create_commit.assert_not_called()


def test_other_http_error_is_reported(checkout, patched, capsys):
    patched.create_commit.side_effect = http_error(500)
    assert push.main(["--root", str(checkout), "--repo", "rmsnorm"]) == 1
    assert "hub request for hubfuse/rmsnorm failed" in capsys.readouterr().err
    patched.upload_file.assert_not_called()


def test_network_error_is_reported(checkout, patched, capsys):
    patched.create_repo.side_effect = ConnectionError("Name or service not known")
    assert push.main(["--root", str(checkout), "--repo", "rmsnorm"]) == 1
    err = capsys.readouterr().err
    assert "upload to hubfuse/rmsnorm failed: ConnectionError" in err and "Traceback" not in err
