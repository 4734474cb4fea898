"""Traces every inlined op's implementation with fake CUDA tensors, in a process of its own (run by
tests/test_inlined_ops.py): the kernels must be Triton's compiled kind, not the interpreter's the CPU tests use,
and torch's analysis of a kernel's writes needs a target, given here by a stand-in driver (sm_90). Nothing runs on
a device. Prints one JSON object: per case, the kernels it launched through `wrap_triton` or the error it raised; the
kernels' f64 operations with Python floats typed as Inductor types them; and the functionalized graphs of
RMSNorm's forward and backward with the switch on and off."""
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class _Driver:
    """Stands in for Triton's CUDA driver: the target torch's TTIR analysis compiles for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


triton.runtime.driver.set_active(_Driver())
torch.cuda.current_device = lambda: 0

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from hubfuse._common import custom_op, device, launch  # noqa: E402

device._sm_count = lambda index: 132
launched = []
fp64_ops = {}  # kernel -> TTIR ops on f64 values with Python floats typed as Inductor types them
_traced_launch = launch._traced_launch
_mangle_type = triton.runtime.jit.mangle_type


def _inductor_type(arg, *args, **kwargs):
    """Triton's type of a kernel argument, but fp64 for a Python float: Inductor's signature of a user kernel
    (`torch._inductor.codegen.triton_utils.signature_of`) types one so, where Triton's own launch types it fp32."""
    return "fp64" if type(arg) is float else _mangle_type(arg, *args, **kwargs)


def _fp64_ops(kernel, args, kwargs) -> list:
    """The kernel's TTIR lines computing on f64 when its Python float arguments come in as fp64 (the function
    signatures and the truncations to f32 aside): Inductor would run them in double precision, or fail to
    compile a loop that carries an fp32 value updated with one (torch's TTIR generation, torch-private)."""
    from torch._higher_order_ops.triton_kernel_wrap import generate_ttir
    from torch._subclasses.functional_tensor import FunctionalTensor

    values = dict(zip(kernel.arg_names, args))
    values.update((name, value) for name, value in kwargs.items() if name in kernel.arg_names)
    values = {name: (v.from_functional() if isinstance(v, FunctionalTensor) else v) for name, v in values.items()}
    triton.runtime.jit.mangle_type = _inductor_type
    try:
        module, _ = generate_ttir(kernel, values, {})
    except Exception as e:  # noqa: BLE001 - reported: it is the failure Inductor would hit
        return [f"{type(e).__name__}: {str(e)[-300:]}"]
    finally:
        triton.runtime.jit.mangle_type = _mangle_type
    return [line.strip()[:160] for line in str(module).splitlines()
            if "f64" in line and "tt.func" not in line and "arith.truncf" not in line]


def _recording(kernel, grid, args, kwargs):
    launched.append(kernel.fn.__name__)
    ops = _fp64_ops(kernel, args, kwargs)
    if ops:
        fp64_ops.setdefault(kernel.fn.__name__, ops[:3])
    return _traced_launch(kernel, grid, args, kwargs)


launch._traced_launch = _recording

from hubfuse.rmsnorm import ops as norm_ops  # noqa: E402
from hubfuse.rmsnorm.reference import GATED, STANDARD, ZERO_CENTERED  # noqa: E402
from hubfuse.rotary import ops as rope_ops  # noqa: E402
from hubfuse.rotary.reference import STANDARD as QK_STANDARD, ZERO_CENTERED as QK_ZERO  # noqa: E402
from hubfuse.swiglu import ops as mlp_ops  # noqa: E402

bf16 = torch.bfloat16


def cases(r):
    """(name, op, args) for every inlined op: every RMSNorm mode, full and partial RoPE, every q/k norm mode."""
    M, N, I, B, S, Hq, Hk, D = 37, 96, 80, 2, 19, 4, 2, 32
    x, dy, gate, w = r(M, N), r(M, N), r(M, N), r(N)
    rstd = r(M, dtype=torch.float32)
    q, k, dq_out, dk_out = r(B, S, Hq, D), r(B, S, Hk, D), r(B, Hq, S, D), r(B, Hk, S, D)
    qw, kw = r(D), r(D)
    out = []
    for mode, g in ((STANDARD, None), (ZERO_CENTERED, None), (GATED, gate)):
        out.append((f"rms_norm_fwd[{mode}]", norm_ops._rms_norm_fwd, (x, w, g, 1e-6, mode)))
        out.append((f"rms_norm_bwd[{mode}]", norm_ops._rms_norm_bwd, (dy, x, w, g, rstd, mode)))
    for rot in (D, D // 2):  # full and partial RoPE
        cos, sin = r(1, S, rot), r(1, S, rot)
        out += [
            (f"rope_fwd[{rot}]", rope_ops._rope_fwd, (q, k, cos, sin, 2)),
            (f"rope_fwd_flat[{rot}]", rope_ops._rope_fwd_flat, (q, k, cos, sin, 2)),
            (f"rope_bwd[{rot}]", rope_ops._rope_bwd, (dq_out, dk_out, cos, sin, 1, [0, 1, 2, 3], [0, 1, 2, 3])),
            (f"rope_fwd_[{rot}]", rope_ops._rope_fwd_, (r(B, S, Hq, D), cos, sin, 2)),
        ]
        for mode in (QK_STANDARD, QK_ZERO):
            out += [
                (f"qk_norm_rope_fwd[{rot},{mode}]", rope_ops._qk_norm_rope_fwd, (q, k, qw, kw, cos, sin, 1e-6, mode)),
                (f"qk_norm_rope_fwd_flat[{rot},{mode}]", rope_ops._qk_norm_rope_fwd_flat,
                 (q, k, qw, kw, cos, sin, 1e-6, mode)),
                (f"qk_norm_rope_bwd[{rot},{mode}]", rope_ops._qk_norm_rope_bwd,
                 (dq_out, dk_out, q, k, qw, kw, cos, sin, 1e-6, mode)),
            ]
    wq, wk, wv = r(Hq * D, N), r(Hk * D, N), r(Hk * D, N)
    x3 = r(B, S, N)
    out += [
        ("qkv_proj_fwd", rope_ops._qkv_proj_fwd, (x3, wq, wk, wv, None, None, None)),
        ("qkv_proj_bwd", rope_ops._qkv_proj_bwd, (r(B, S, Hq * D), r(B, S, Hk * D), r(B, S, Hk * D), x3, wq, wk, wv,
                                                  False)),
    ]
    gate_up, w_gu, w_down, dout = r(M, 2 * I), r(2 * I, N), r(N, I), r(M, N)
    out += [
        ("swiglu_fwd", mlp_ops._swiglu_fwd, (gate_up,)),
        ("swiglu_bwd", mlp_ops._swiglu_bwd, (r(M, I), gate_up)),
        ("swiglu_down_fwd", mlp_ops._swiglu_down_fwd, (gate_up, w_down, None)),
        ("swiglu_down_bwd", mlp_ops._swiglu_down_bwd, (dout, r(M, 2 * I), w_down, False)),
        ("swiglu_down_bwd_functional", mlp_ops._swiglu_down_bwd_functional, (dout, gate_up, w_down, False)),
        ("rms_norm_gate_up_fwd", mlp_ops._rms_norm_gate_up_fwd, (x, w, 1e-6, w_gu, None)),
        ("rms_norm_gate_up_bwd", mlp_ops._rms_norm_gate_up_bwd, (gate_up, x, w, rstd, w_gu, False)),
    ]
    return out


def rms_norm_graph(switch):
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    os.environ[custom_op.INLINE_SWITCH] = switch

    def step(x, w, dy):
        y, rstd = norm_ops._rms_norm_fwd(x, w, None, 1e-6, STANDARD)
        dx, dw, _ = norm_ops._rms_norm_bwd(dy, x, w, None, rstd, STANDARD)
        return y, dx, dw

    with FakeTensorMode(allow_non_fake_inputs=True):
        x, dy, w = torch.randn(37, 96, device="cuda", dtype=bf16), torch.randn(37, 96, device="cuda", dtype=bf16), \
            torch.randn(96, device="cuda", dtype=bf16)
    graph = make_fx(dispatch_functionalize(step), tracing_mode="fake")(x, w, dy).graph
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def main():
    results = {}
    with FakeTensorMode():
        def r(*shape, dtype=bf16):
            return torch.randn(*shape, device="cuda", dtype=dtype)

        for name, op, args in cases(r):
            assert getattr(op, "eager_impl", None) is not None, name
            del launched[:]
            try:
                op.eager_impl(*args)
                results[name] = {"launched": list(launched)}
            except Exception as e:  # noqa: BLE001 - reported, the test names it
                results[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
    graphs = {switch: rms_norm_graph(switch) for switch in ("1", "0")}
    json.dump({"cases": results, "graphs": graphs, "fp64_ops": fp64_ops}, sys.stdout)


if __name__ == "__main__":
    main()
