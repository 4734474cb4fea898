#!/usr/bin/env python
"""Publish hubfuse kernel repos to the Hugging Face Hub, like `kernel-builder upload`.

For each kernel repo (`hubfuse.build.discover_repos`: the repository root, if it has a build.toml, and every
kernel_repos/*/):
  1. create the hub repo (repo_type="kernel", exist_ok);
  2. create branch v<version> from main if missing;
  3. one commit to v<version>: build/torch-*/** and benchmarks/benchmark*.py, deleting stale
     files under the uploaded build/<variant>/ dirs and benchmarks/;
  4. CARD.md to main as README.md.

    python scripts/push.py --dry-run                 # print the plan, write nothing
    python scripts/push.py --org my-org --repo rmsnorm
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

REPO_TYPE = "kernel"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "torch-ext"))

from hubfuse.build import BuildError, discover_repos  # noqa: E402


class PushError(Exception):
    """A problem reported to the user as one message, without a traceback."""


@dataclass(frozen=True)
class UploadPlan:
    name: str
    repo_dir: Path
    repo_id: str
    version: int
    variants: tuple[str, ...]  # e.g. ("torch-cpu", "torch-cuda")
    files: tuple[tuple[str, Path], ...]  # (path in repo, local file), sorted by path in repo
    card: Path

    @property
    def branch(self) -> str:
        return f"v{self.version}"

    @property
    def managed_prefixes(self) -> tuple[str, ...]:
        """Remote dirs this upload owns: files there that are not uploaded get deleted."""
        return tuple(f"build/{v}/" for v in self.variants) + ("benchmarks/",)


def read_build_toml(repo_dir: Path) -> tuple[str, int, str]:
    """(name, version, repo-id) from repo_dir/build.toml."""
    path = repo_dir / "build.toml"
    try:
        general = tomllib.loads(path.read_text())["general"]
        name, version, repo_id = general["name"], general["version"], general["hub"]["repo-id"]
    except FileNotFoundError:
        raise PushError(f"{path} not found") from None
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as e:
        raise PushError(
            f"{path}: cannot read [general] name / version / [general.hub] repo-id ({e!r})"
        ) from None
    if not isinstance(version, int) or isinstance(version, bool):
        raise PushError(f"{path}: [general] version must be an integer, got {version!r}")
    return name, version, repo_id


def _variant_files(variant_dir: Path) -> list[Path]:
    return [
        p
        for p in variant_dir.rglob("*")
        if p.is_file()
        and p.suffix != ".pyc"
        and "__pycache__" not in p.relative_to(variant_dir).parts
    ]


def plan_upload(repo_dir: Path, org: str | None = None) -> UploadPlan:
    """Everything to upload for one kernel repo, read from disk only (no hub calls)."""
    repo_dir = Path(repo_dir)
    name, version, repo_id = read_build_toml(repo_dir)
    if org:
        repo_id = f"{org}/{repo_id.split('/')[-1]}"

    card = repo_dir / "CARD.md"
    if not card.is_file():
        raise PushError(f"{name}: {card} is missing (it becomes README.md on the hub repo)")

    build = repo_dir / "build"
    variant_dirs = sorted(p for p in build.glob("torch-*") if p.is_dir())
    if not variant_dirs:
        raise PushError(
            f"{name}: no build output in {build}/torch-*; run `python scripts/build.py` first"
        )

    # Every variant must carry the build.toml version: it names the v<N> branch.
    versions = {}
    for vdir in variant_dirs:
        meta = vdir / "metadata.json"
        try:
            versions[vdir.name] = json.loads(meta.read_text()).get("version")
        except FileNotFoundError:
            raise PushError(
                f"{name}: {meta} is missing; run `python scripts/build.py` first"
            ) from None
        except (json.JSONDecodeError, AttributeError) as e:
            raise PushError(f"{name}: {meta} is not a JSON object ({e})") from None
    if any(v != version for v in versions.values()):
        found = ", ".join(f"{k}={v!r}" for k, v in versions.items())
        raise PushError(
            f"{name}: version mismatch: build.toml has version={version}, metadata.json has "
            f"{found}; rebuild with `python scripts/build.py`"
        )

    files = [p for vdir in variant_dirs for p in _variant_files(vdir)]
    files += [p for p in (repo_dir / "benchmarks").glob("benchmark*.py") if p.is_file()]
    return UploadPlan(
        name=name,
        repo_dir=repo_dir,
        repo_id=repo_id,
        version=version,
        variants=tuple(v.name for v in variant_dirs),
        files=tuple(sorted((p.relative_to(repo_dir).as_posix(), p) for p in files)),
        card=card,
    )


def stale_files(plan: UploadPlan, existing: list[str]) -> list[str]:
    """Remote files under the plan's managed prefixes that the new upload does not contain."""
    new = {path for path, _ in plan.files}
    return sorted(
        f for f in existing if f.startswith(plan.managed_prefixes) and f not in new
    )


def remote_state(plan: UploadPlan, api: HfApi) -> tuple[bool, list[str]]:
    """(branch exists, files on the branch). A missing repo has neither."""
    try:
        refs = api.list_repo_refs(plan.repo_id, repo_type=REPO_TYPE)
    except RepositoryNotFoundError:
        return False, []
    if plan.branch not in {b.name for b in refs.branches}:
        return False, []
    return True, list(api.list_repo_files(plan.repo_id, revision=plan.branch, repo_type=REPO_TYPE))


def execute(plan: UploadPlan, api: HfApi, create_pr: bool = False, private: bool = False) -> None:
    """Perform the upload described by `plan`."""
    # private=None leaves the hub's default for a new repo; an existing repo is not changed.
    api.create_repo(plan.repo_id, repo_type=REPO_TYPE, exist_ok=True, private=private or None)
    branch_exists, existing = remote_state(plan, api)
    if not branch_exists:
        api.create_branch(plan.repo_id, branch=plan.branch, repo_type=REPO_TYPE, exist_ok=True)

    stale = stale_files(plan, existing)
    operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(f)) for p, f in plan.files]
    operations += [CommitOperationDelete(path_in_repo=p) for p in stale]
    api.create_commit(
        plan.repo_id,
        operations=operations,
        commit_message=f"Upload {plan.name} {plan.branch} ({', '.join(plan.variants)})",
        revision=plan.branch,
        repo_type=REPO_TYPE,
        create_pr=create_pr,
    )
    api.upload_file(
        path_or_fileobj=str(plan.card),
        path_in_repo="README.md",
        repo_id=plan.repo_id,
        repo_type=REPO_TYPE,
        revision="main",
        commit_message=f"Update README.md from {plan.name} CARD.md",
        create_pr=create_pr,
    )
    print(
        f"pushed {plan.name} -> {plan.repo_id}@{plan.branch}: {len(plan.files)} files added, "
        f"{len(stale)} stale deleted; README.md on main" + (" (as pull requests)" if create_pr else "")
    )


def dry_run(
    plan: UploadPlan, api: HfApi | None, create_pr: bool = False, private: bool = False
) -> list[str]:
    """The operations `execute` would do, one line each. Only read calls are made on `api`."""
    rid, br = plan.repo_id, plan.branch
    pr = " (pull request)" if create_pr else ""
    lines = [
        f"# {plan.name}: {plan.repo_dir} -> {rid} {br} ({', '.join(plan.variants)})",
        f"create_repo {rid} (kernel{', private' if private else ''})",
    ]
    unknown = None
    if api is None:
        unknown = "no token"
    else:
        try:
            branch_exists, existing = remote_state(plan, api)
        except Exception as e:  # offline, auth, ...: the plan itself is still useful
            unknown = f"cannot read the hub: {type(e).__name__}: {e}".splitlines()[0]
    if unknown:
        lines.append(f"create_branch {rid} {br} (if missing)")
    elif not branch_exists:
        lines.append(f"create_branch {rid} {br}")
    lines += [f"add {path} -> {rid}@{br}{pr}" for path, _ in plan.files]
    if unknown:
        lines.append(
            f"# deletes unknown ({unknown}): stale files on {br} under "
            f"{', '.join(plan.managed_prefixes)} would be deleted"
        )
    else:
        lines += [f"delete {path} -> {rid}@{br}{pr}" for path in stale_files(plan, existing)]
    lines.append(f"upload CARD.md -> {rid}@main:README.md{pr}")
    return lines


def _http_error_message(e: HfHubHTTPError, plan: UploadPlan) -> str:
    status = e.response.status_code if e.response is not None else None
    if status in (401, 403):
        org = plan.repo_id.split("/")[0]
        return (
            f"{plan.name}: HTTP {status}: no permission to create/write kernel repos under "
            f"'{org}' ({plan.repo_id}). Kernel-type repos need kernel-creation access on the "
            f"account or org; check the token has write access (`hf auth login` or set HF_TOKEN), "
            f"or pick another org with --org."
        )
    return f"{plan.name}: hub request for {plan.repo_id} failed: {e}".splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--org", help="replace the org of every build.toml repo-id")
    select = parser.add_mutually_exclusive_group()
    select.add_argument("--repo", action="append", metavar="NAME", help="kernel name (repeatable)")
    select.add_argument("--all", action="store_true", help="every kernel repo (the default)")
    parser.add_argument("--dry-run", action="store_true", help="print the operations, write nothing")
    parser.add_argument("--create-pr", action="store_true", help="open pull requests instead of committing")
    parser.add_argument("--private", action="store_true", help="create new repos as private")
    parser.add_argument("--root", type=Path, default=ROOT, help="hubfuse checkout (default: this one)")
    args = parser.parse_args(argv)

    try:
        try:
            repos = discover_repos(args.root)
        except BuildError as e:
            raise PushError(str(e)) from None
        if not repos:
            raise PushError(f"no kernel repos found in {args.root} (build.toml, kernel_repos/*/build.toml)")
        names = args.repo or list(repos)
        unknown = [n for n in names if n not in repos]
        if unknown:
            print(f"error: unknown kernel repo(s): {', '.join(unknown)}; known: {', '.join(repos)}",
                  file=sys.stderr)
            return 2
        # Validate every selected repo before writing anything.
        plans = [plan_upload(repos[n], org=args.org) for n in dict.fromkeys(names)]
    except PushError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    token = get_token()
    if args.dry_run:
        api = HfApi(token=token) if token else None
        for plan in plans:
            print("\n".join(dry_run(plan, api, create_pr=args.create_pr, private=args.private)))
        return 0

    if not token:
        print("error: no Hugging Face token found; run `hf auth login` or set HF_TOKEN", file=sys.stderr)
        return 1
    api = HfApi(token=token)
    for plan in plans:
        try:
            execute(plan, api, create_pr=args.create_pr, private=args.private)
        except HfHubHTTPError as e:
            print(f"error: {_http_error_message(e, plan)}", file=sys.stderr)
            return 1
        except Exception as e:  # network down, offline mode, ...: one line, no traceback
            msg = f"{plan.name}: upload to {plan.repo_id} failed: {type(e).__name__}: {e}"
            print(f"error: {msg.splitlines()[0]}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
