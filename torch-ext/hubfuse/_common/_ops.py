"""Op namespace helper (source form): every op of every op package is registered under this namespace.

`hubfuse/build.py` replaces this file in every build variant with a fixed namespace that is unique per
variant and per source state, as kernel-builder does. In the source tree the namespace is derived from the
import name (`_hubfuse__common`), so a built variant loaded beside the source never registers the same op.
"""
import torch

_NAMESPACE = "_" + __name__.rpartition(".")[0].replace(".", "_")
ops = getattr(torch.ops, _NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    return f"{_NAMESPACE}::{op_name}"
