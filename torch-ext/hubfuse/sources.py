"""Where the kernels come from: the hub org `hubfuse` by default, or this clone's local builds, in one call.

    import hubfuse
    hubfuse.use_local_builds()      # hubfuse.build for every repo, then LOCAL_KERNELS=hubfuse/<repo>=<its dir>:...

After it, `hubfuse.KernelConfig()` and `hubfuse.presets` load every `hubfuse/<repo>` from this clone's builds and
ask for `revision="v1"` (the `kernels` library resolves a `version` against the hub's branches before it reads
LOCAL_KERNELS, so a version cannot be served locally). `KernelConfig(local=True)` does the same.

`load_layer` loads one kernel layer and turns the `kernels` library's failures into messages that name the cause
(repo not found, with the names that exist; a version on a local build; a layer the repo does not have).

Standard library only at import time (the umbrella hub kernel ships this module).
"""
from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path

ORG = "hubfuse"
VERSION = 1  # major version of every hubfuse kernel repo (build.toml general.version)
LOCAL_REVISION = f"v{VERSION}"
_PACKAGE = Path(__file__).resolve().parent
# the clone of the source tree (torch-ext/hubfuse/sources.py, an editable install); None in a built hub variant
_CLONE = _PACKAGE.parents[1] if _PACKAGE.parent.name == "torch-ext" else None


def local_builds() -> dict[str, Path]:
    """repo id -> path of every LOCAL_KERNELS entry (the `kernels` library's local overrides)."""
    entries = {}
    for entry in os.environ.get("LOCAL_KERNELS", "").split(":"):
        if "=" in entry:
            repo_id, path = entry.split("=", 1)
            entries[repo_id] = Path(path)
    return entries


def is_local(repo_id: str) -> bool:
    return repo_id in local_builds()


def default_meta(repo_id: str) -> dict:
    """`{"revision": "v1"}` for a local build, `{"version": 1}` for the hub."""
    return {"revision": LOCAL_REVISION} if is_local(repo_id) else {"version": VERSION}


def check_not_version_on_local(repo_id: str, meta: dict, where: str) -> None:
    """A `version` for a local build fails deep inside `kernels` (it asks the hub for the repo's branches first,
    an httpx ConnectError offline): say so, and what to pass instead."""
    if meta.get("version") is not None and meta.get("revision") is None and is_local(repo_id):
        raise ValueError(
            f"{where}: {repo_id!r} is a local build (LOCAL_KERNELS -> {local_builds()[repo_id]}), but the entry asks "
            f"for version={meta['version']!r}; the kernels library resolves a version against the hub's branches "
            f"before it reads LOCAL_KERNELS. Use {{'revision': {LOCAL_REVISION!r}}} instead (hubfuse.presets and "
            f"hubfuse.KernelConfig() choose it by themselves for local builds).")


def clone_root(root=None) -> Path:
    """The hubfuse clone whose kernel repos are built: `root`, or the one this package is installed from."""
    root = Path(root).resolve() if root is not None else _CLONE
    if root is None:
        raise FileNotFoundError(f"hubfuse is loaded from {_PACKAGE}, a built hub kernel, not from a clone: local "
                                f"builds need hubfuse installed from the source tree (`pip install -e <clone>`)")
    if not (root / "build.toml").is_file() or not (root / "kernel_repos").is_dir():
        raise FileNotFoundError(
            f"{root} is not a hubfuse clone (no build.toml and kernel_repos/): local builds need the source "
            f"tree; pass use_local_builds(root=<your clone>), or load from the hub without local builds")
    return root


def use_local_builds(root=None, *, build: bool = True, org: str = ORG) -> dict[str, Path]:
    """Build every kernel repo of the clone (`hubfuse.build`: validate, build, prove each variant loads) and
    point LOCAL_KERNELS at them as `<org>/<repo>` (the umbrella is `<org>/hubfuse`), keeping other entries.

    `build=False` only registers existing builds (run `python scripts/build.py` first). Returns repo id -> path.
    """
    root = clone_root(root if _CLONE is not None else None)  # a hub variant has no build tool
    from . import build as builder

    repos = builder.discover_repos(root)
    for name, path in repos.items():
        if build:
            try:
                builder.build_repo(path, repos)
            except builder.BuildError as e:
                raise RuntimeError(f"use_local_builds: building {name} failed: {e}") from None
        elif not (path / "build").is_dir():
            raise FileNotFoundError(f"use_local_builds(build=False): {path} has no build/; run "
                                    f"`python scripts/build.py` first (or use_local_builds())")
    entries = {repo_id: str(p) for repo_id, p in local_builds().items()}
    registered = {f"{org}/{name}": path for name, path in repos.items()}
    entries.update({repo_id: str(path) for repo_id, path in registered.items()})
    os.environ["LOCAL_KERNELS"] = ":".join(f"{k}={v}" for k, v in entries.items())
    return registered


def clone_repo_names() -> list[str]:
    """Kernel repo names of the clone this package is installed from (empty outside a clone)."""
    try:
        root = clone_root()
    except FileNotFoundError:
        return []
    from .build import discover_repos

    return list(discover_repos(root))


def suggest(name: str, names, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].rstrip('.') if text else ''}"


def org_repos() -> list[str]:
    """Kernel repo names under the hubfuse org: the presets' repos, the umbrella, and this clone's repos."""
    from . import presets

    return sorted(set(presets.known_repos()) | set(clone_repo_names()))


def _available(org: str) -> str:
    local = sorted(local_builds())
    published = [f"{org}/{name}" for name in org_repos()] if org == ORG else []
    parts = [f"local builds (LOCAL_KERNELS): {', '.join(local) if local else 'none'}"]
    if published:
        parts.append(f"{ORG} repos known here (the presets and this clone): {', '.join(published)}")
    return "; ".join(parts)


def load_kernel(repo_id: str, meta: dict, *, where: str = "hubfuse"):
    """The kernel module of `repo_id` (`meta`: revision / version / trust_remote_code), loaded as transformers
    would, with errors that name the cause."""
    from kernels import get_kernel

    check_not_version_on_local(repo_id, meta, where)
    org, _, name = repo_id.partition("/")
    if is_local(repo_id):
        path = local_builds()[repo_id]
        if not (path / "build").is_dir() and not (path / "metadata.json").is_file():
            raise FileNotFoundError(f"{where}: LOCAL_KERNELS points {repo_id!r} at {path}, which holds no build; "
                                    f"run `python scripts/build.py` or hubfuse.use_local_builds()")
    elif org == ORG and name not in org_repos():
        raise ValueError(f"{where}: kernel repo {repo_id!r} not found"
                         f"{suggest(name, org_repos(), prefix=org + '/')}; "
                         f"{_available(org)}")
    kwargs = {k: meta[k] for k in ("revision", "version", "trust_remote_code") if meta.get(k) is not None}
    if "revision" not in kwargs and "version" not in kwargs:
        kwargs["version"] = VERSION
    try:
        return get_kernel(repo_id, **kwargs)
    except (ImportError, SyntaxError):
        raise
    except Exception as e:
        if is_local(repo_id):
            raise
        local_builds_hint = "call hubfuse.use_local_builds() first, or use hubfuse.KernelConfig(local=True)"
        if "not from a trusted publisher" in str(e):
            cause, hint = _first_line(e), (f"To load {org}'s kernels from the hub pass trust_remote_code=True "
                                           f"(hubfuse.KernelConfig(trust_remote_code=True))")
        elif "could not verify publisher trust status" in str(e):
            # kernels asks the hub for the publisher first; its advice (trust_remote_code) does not help offline
            cause = f"the hub could not be reached (or has no org {org!r}) to check the publisher"
            hint = (f"Offline, use this clone's builds: {local_builds_hint}; a kernel already in the hub cache "
                    f"loads with HF_HUB_OFFLINE=1")
        else:
            cause, hint = _first_line(e), f"For this clone's builds {local_builds_hint}"
        raise ValueError(f"{where}: kernel repo {repo_id!r} could not be loaded from the hub: {cause}. "
                         f"It is not a local build; {_available(org)}. {hint}") from e


def load_layer(repo_name: str, meta: dict, *, use_local_kernel: bool = False, where: str = "hubfuse"):
    """(kernel layer class, its `<Layer>Layout` or None) for `"org/repo:Layer"` (or `"/path:Layer"` with
    `use_local_kernel`), with errors that name the cause."""
    repo_id, _, layer = repo_name.partition(":")
    if use_local_kernel:
        from kernels import get_local_kernel

        try:
            module = get_local_kernel(Path(repo_id))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{where}: no kernel build at {repo_id} ({_first_line(e)}); run "
                                    f"`python scripts/build.py` there") from e
    else:
        module = load_kernel(repo_id, meta, where=where)
    layers = getattr(module, "layers", None)
    cls = getattr(layers, layer, None) if layers is not None else None
    if cls is None:
        names = sorted(n for n in getattr(layers, "__all__", dir(layers or object())) if not n.endswith("Layout"))
        raise ValueError(f"{where}: kernel repo {repo_id!r} has no layer {layer!r}{suggest(layer, names)}; its layers: "
                         f"{', '.join(names) if names else 'none'}")
    # where transformers looks for it: beside the class, in the module that defines it
    return cls, getattr(sys.modules.get(cls.__module__), f"{cls.__name__}Layout", None)
