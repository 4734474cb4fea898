"""Op namespace helper (source form).

`scripts/build.py` replaces this file in every build variant with a fixed namespace that is unique per
variant and per source state, as kernel-builder does. In the source tree the namespace is derived from the
package's import name, so two copies of the package never register the same op.
"""
import torch

_NAMESPACE = "_" + __name__.rpartition(".")[0].replace(".", "_")
ops = getattr(torch.ops, _NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    return f"{_NAMESPACE}::{op_name}"
