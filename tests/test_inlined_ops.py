"""`_common.custom_op`'s inlining under torch.compile, on CPU: an op with `inline=True` whose tensors are on CUDA
is replaced, when AOTAutograd functionalizes the graph, by its traced implementation (its Triton launches as
`triton_kernel_wrapper_functional` nodes, `_common.launch`); on CPU, with dynamic shapes, or with
HUBFUSE_INLINE_OPS=0, it stays one node. Traced with fake CUDA tensors (no GPU needed: nothing runs), in a process of its own
(`tests/inlined_ops_trace.py`), which also builds each launched kernel's TTIR with Python floats typed as Inductor
types them (fp64). Also the torch-private names the two modules and that helper use: the tests fail when torch
changes them. What the inlined graphs compute is checked on the GPU
(`tests/test_compile_training.py::test_compiled_ops_inlined_on_cuda`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hubfuse._common import custom_op


@pytest.fixture(scope="module")
def traced():
    """tests/inlined_ops_trace.py's report (a process of its own: compiled kernels, a stand-in driver)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("inlined_ops_trace.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_inlined_op_traces_with_its_launches(traced):
    """Each inlined op's implementation on fake CUDA tensors (every RMSNorm mode, full and partial RoPE, both q/k
    norms, the MLP's ops): it runs, and each Triton launch is a `wrap_triton` call that passes the aliasing check
    against torch's own analysis of the kernel. Fails, for one, with the partial-sum kernel's placeholder output
    stored to outside a constexpr branch."""
    errors = {name: case["error"] for name, case in traced["cases"].items() if "error" in case}
    assert not errors, errors
    assert len(traced["cases"]) == 35
    for name, case in traced["cases"].items():
        assert bool(case["launched"]) == (not name.startswith("qkv_proj")), (name, case)  # qkv: GEMMs only
    assert traced["cases"]["rms_norm_bwd[2]"]["launched"] == ["_rms_norm_bwd_kernel", "_sum_partials_kernel"]


def test_inlined_kernels_compute_in_fp32_under_inductor(traced):
    """Inductor types a user kernel's Python float argument fp64 (Triton's own launch: fp32). Every kernel an
    inlined op launches casts its float arguments to fp32 first, so nothing runs in double precision under
    torch.compile and no fp32 loop value turns fp64 (a compile error on the GPU: rotary's weight-gradient sums
    with eps). Fails without the casts in rmsnorm's and rotary's kernels."""
    assert traced["fp64_ops"] == {}, traced["fp64_ops"]


def test_cuda_op_is_replaced_by_its_launches(traced):
    targets = traced["graphs"]["1"]
    assert sum("triton_kernel_wrapper_functional" in t for t in targets) == 3  # forward, backward, partial sums
    assert not any("rms_norm" in t for t in targets), targets


def test_op_stays_one_node_switched_off(traced):
    targets = traced["graphs"]["0"]
    assert [t.split(".")[-2] for t in targets if "rms_norm" in t] == ["rms_norm_fwd", "rms_norm_bwd"], targets
    assert not any("triton_kernel_wrapper" in t for t in targets)


def test_cpu_op_stays_one_node(monkeypatch):
    """On CPU (the reference path) an inlined op is not replaced: the functionalized graph keeps it."""
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from hubfuse.rmsnorm import ops

    monkeypatch.setenv(custom_op.INLINE_SWITCH, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w = torch.randn(5, 8), torch.randn(8)
    graph = make_fx(dispatch_functionalize(lambda x, w: ops._rms_norm_fwd(x, w, None, 1e-6, 0)))(x, w).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert any("rms_norm_fwd" in t for t in targets) and not any("triton_kernel_wrapper" in t for t in targets)


def test_inline_switch_and_conditions(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode():
        cuda = torch.empty(2, device="cuda")
    monkeypatch.setenv(custom_op.INLINE_SWITCH, "1")
    assert custom_op._inline_on((3, cuda)) and not custom_op._inline_on((torch.empty(2),))
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        dynamic = torch.empty(shape_env.create_unbacked_symint(), 4, device="cuda")
    assert not custom_op._inline_on((cuda, dynamic))  # a graph compiled for dynamic shapes: the op stays opaque
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not custom_op._inline_on((cuda,))  # ROCm: the opaque op
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv(custom_op.INLINE_SWITCH, "0")
    assert not custom_op._inline_on((cuda,))
    monkeypatch.setenv(custom_op.INLINE_SWITCH, "yes")
    with pytest.raises(ValueError, match="HUBFUSE_INLINE_OPS must be 0 or 1, got 'yes'"):
        custom_op._inline_on((cuda,))


def test_torch_private_names_exist():
    """The torch-private names of `_common.custom_op` and `_common.launch`."""
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._library.custom_ops import CustomOpDef
    from torch._subclasses.fake_tensor import is_fake
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    assert callable(is_fake) and callable(FunctionalTensor.from_functional)
    assert callable(CustomOpDef.register_torch_dispatch) and isinstance(FunctionalTensorMode, type)
    assert callable(getattr(triton_kernel_wrap, "identify_accessed_tensors", None)
                    or getattr(triton_kernel_wrap, "identify_mutated_tensors", None))
    assert callable(triton_kernel_wrap.generate_ttir)  # tests/inlined_ops_trace.py
    assert callable(torch.library.wrap_triton)
