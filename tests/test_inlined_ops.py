"""`_common.custom_op`'s inlining under torch.compile, on CPU: an op with `inline=True` whose tensors are on CUDA
is replaced, when AOTAutograd functionalizes the graph, by its traced implementation (its Triton launches as
`triton_kernel_wrapper_functional` nodes, `_common.launch`); on CPU, with dynamic shapes, or with
HUBFUSE_INLINE_OPS=0, it stays one node. Traced here with fake CUDA tensors (no GPU needed: nothing runs). Also the torch-private names the two
modules use: the tests fail when torch changes them. What the inlined graphs compute is checked on the GPU
(`tests/test_compile_training.py::test_compiled_ops_inlined_on_cuda`)."""
import pytest
import torch

from hubfuse._common import custom_op, device, launch


def _traced_rms_norm(monkeypatch, device_type):
    """The functionalized graph of RMSNorm's forward then backward (the inlined ops of the dense path)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from hubfuse.rmsnorm import ops

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CUDA tensors take the Triton path, compiled kernels
    monkeypatch.setattr(device, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # torch's TTIR analysis needs a GPU: the launches here write only what they are meant to
    monkeypatch.setattr(launch, "_written_arguments", lambda kernel, values: set())

    def step(x, w, dy):
        y, rstd = ops._rms_norm_fwd(x, w, None, 1e-6, 0)
        dx, dw, _ = ops._rms_norm_bwd(dy, x, w, None, rstd, 0)
        return y, dx, dw

    with FakeTensorMode(allow_non_fake_inputs=True):
        x, dy = (torch.randn(37, 96, device=device_type, dtype=torch.bfloat16) for _ in range(2))
        w = torch.randn(96, device=device_type, dtype=torch.bfloat16)
    graph = make_fx(dispatch_functionalize(step), tracing_mode="fake")(x, w, dy).graph
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


@pytest.mark.filterwarnings("ignore")
def test_cuda_op_is_replaced_by_its_launches(monkeypatch):
    monkeypatch.setenv(custom_op.INLINE_SWITCH, "1")
    targets = _traced_rms_norm(monkeypatch, "cuda")
    assert sum("triton_kernel_wrapper_functional" in t for t in targets) == 3  # forward, backward, partial sums
    assert not any("rms_norm" in t for t in targets), targets


@pytest.mark.parametrize("switch, device_type", [("0", "cuda"), ("1", "cpu")])
def test_op_stays_one_node_off_cuda_or_switched_off(monkeypatch, switch, device_type):
    monkeypatch.setenv(custom_op.INLINE_SWITCH, switch)
    targets = _traced_rms_norm(monkeypatch, device_type)
    assert [t.split(".")[-2] for t in targets if "rms_norm" in t] == ["rms_norm_fwd", "rms_norm_bwd"], targets
    assert not any("triton_kernel_wrapper" in t for t in targets)


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
    assert callable(torch.library.wrap_triton)
