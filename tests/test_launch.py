"""hubfuse._common.launch: the cached launch path keys every specialisation Triton compiles for, binds
arguments in signature order, and falls back to Triton's own launch where it cannot key or launch."""
import importlib.util

import pytest
import torch


def _load_launch_module():
    """A private copy of hubfuse._common.launch (its module state is the test's own)."""
    from hubfuse._common import launch

    spec = importlib.util.spec_from_file_location("hubfuse_common_launch_copy", launch.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sample(X, Y, n, alpha, BLOCK: "tl.constexpr", FLAG: "tl.constexpr" = 3):  # noqa: F821
    pass


class _FakeCompiled:
    """Stands in for Triton's CompiledKernel: records the launcher calls."""

    def __init__(self, fail_with=None):
        self.function, self.packed_metadata, self.calls, self.fail_with = object(), object(), [], fail_with

    def run(self, *args):
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append(args)


@pytest.fixture
def fake(monkeypatch):
    """(launch module, a JITFunction whose Triton launches are recorded, the list of Triton launches)."""
    import triton

    lm = _load_launch_module()
    monkeypatch.setattr(lm, "_fast_path", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    kernel = triton.runtime.jit.JITFunction(_sample)
    triton_launches = []

    def triton_run(*args, grid, warmup, **kwargs):
        triton_launches.append((grid, args, kwargs))
        compiled = _FakeCompiled()
        kernel._last_compiled = compiled
        return compiled

    monkeypatch.setattr(kernel, "run", triton_run)
    return lm, kernel, triton_launches


def test_second_launch_takes_the_compiled_kernels_launcher(fake):
    lm, kernel, triton_launches = fake
    x, y = torch.randn(64), torch.randn(64)
    lm.launch(kernel, (4,), x, y, 64, 0.5, BLOCK=16, num_warps=4)
    assert len(triton_launches) == 1
    compiled = kernel._last_compiled
    lm.launch(kernel, (5, 2), x, y, 64, 0.25, BLOCK=16, num_warps=4)
    assert len(triton_launches) == 1, "same specialisation: no second trip through Triton"
    (call,) = compiled.calls
    # grid, stream, function, metadata, (launch metadata, enter hook, exit hook), then every parameter in order,
    # defaults and constexprs included
    assert call[:4] == (5, 2, 1, 1234) and call[4] is compiled.function and call[5] is compiled.packed_metadata
    assert call[6:9] == (None, None, None)
    assert call[9] is x and call[10] is y and call[11:] == (64, 0.25, 16, 3)


@pytest.mark.parametrize("change", [
    lambda a: dict(a, n=65),  # no longer a multiple of 16
    lambda a: dict(a, n=1),  # Triton specialises 1 as a constant
    lambda a: dict(a, n=2**31),  # 64-bit integer
    lambda a: dict(a, x=torch.randn(65)[1:]),  # address not 16-byte aligned
    lambda a: dict(a, x=torch.randn(64, dtype=torch.float64)),  # another dtype
    lambda a: dict(a, BLOCK=32),  # another constexpr
    lambda a: dict(a, FLAG=4),  # a constexpr default overridden
    lambda a: dict(a, num_warps=8),  # another launch option
])
def test_every_specialisation_change_goes_through_triton(fake, change):
    lm, kernel, triton_launches = fake
    base = dict(x=torch.randn(64), y=torch.randn(64), n=64, alpha=0.5, BLOCK=16, num_warps=4)
    for args in (base, base, change(base)):
        kw = dict(args)
        lm.launch(kernel, (1,), kw.pop("x"), kw.pop("y"), kw.pop("n"), kw.pop("alpha"), **kw)
    assert len(triton_launches) == 2


def _noop_hook(*args):
    pass


def test_unkeyable_argument_and_launch_hooks_take_tritons_path(fake, monkeypatch):
    import triton

    lm, kernel, triton_launches = fake
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        lm.launch(kernel, (1,), x, y, [64], 0.5, BLOCK=16)  # a list argument: not keyable
    assert len(triton_launches) == 2
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16)
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [_noop_hook])  # what a profiler adds
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16)  # cached, but a profiler hook is installed
    assert len(triton_launches) == 4


def test_a_launcher_with_another_signature_disables_the_fast_path(fake):
    lm, kernel, triton_launches = fake
    x, y = torch.randn(64), torch.randn(64)
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16)
    kernel._last_compiled.fail_with = TypeError("launcher takes other arguments")
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16)
    assert len(triton_launches) == 2 and lm._fast_path is False
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16)
    assert len(triton_launches) == 3


def _run_needing_stages(kernel, monkeypatch, most_stages):
    """kernel.run raising Triton's OutOfResources (shared memory) above `most_stages` pipeline stages; returns the
    list of num_stages each Triton launch asked for."""
    import triton

    asked, fits = [], kernel.run

    def run(*args, **kwargs):
        asked.append(kwargs.get("num_stages"))
        if (kwargs.get("num_stages") or 3) > most_stages:
            raise triton.runtime.errors.OutOfResources(246272, 232448, "shared memory")
        return fits(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", run)
    return asked


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_kernel_too_big_for_shared_memory_is_compiled_with_fewer_stages(fake, monkeypatch, fast_path):
    lm, kernel, triton_launches = fake
    monkeypatch.setattr(lm, "_fast_path", fast_path)
    asked = _run_needing_stages(kernel, monkeypatch, most_stages=1)
    x, y = torch.randn(64), torch.randn(64)
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16, num_stages=3)
    assert asked == [3, 2, 1] and len(triton_launches) == 1
    lm.launch(kernel, (1,), x, y, 64, 0.5, BLOCK=16, num_stages=3)
    if fast_path:  # the one-stage kernel, under the original settings' key: no second trip through Triton
        assert asked == [3, 2, 1] and len(kernel._last_compiled.calls) == 1
    else:
        assert asked == [3, 2, 1, 3, 2, 1] and len(triton_launches) == 2


def test_a_kernel_too_big_at_one_stage_raises_tritons_error(fake, monkeypatch):
    import triton

    lm, kernel, triton_launches = fake
    asked = _run_needing_stages(kernel, monkeypatch, most_stages=0)
    with pytest.raises(triton.runtime.errors.OutOfResources):
        lm.launch(kernel, (1,), torch.randn(4), torch.randn(4), 4, 0.5, BLOCK=16)  # Triton's default: 3 stages
    assert asked == [None, 2, 1] and not triton_launches


def test_missing_argument_is_a_clear_error(fake):
    lm, kernel, _ = fake
    lm.launch(kernel, (1,), torch.randn(4), torch.randn(4), 4, 0.5, BLOCK=16)
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        lm.launch(kernel, (1,), torch.randn(4), torch.randn(4), 4, 0.5)


class _WrapRecorder:
    """Stands in for `torch.library.wrap_triton`: records (kernel, grid, args, kwargs) of each traced launch."""

    def __init__(self):
        self.calls = []

    def __call__(self, kernel):
        recorder = self

        class _Wrapped:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: recorder.calls.append((kernel, grid, args, kwargs))

        return _Wrapped()


@pytest.fixture
def traced(fake, monkeypatch):
    """(launch module, kernel, Triton's launches, wrap_triton's recorder, fake tensors x and y)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lm, kernel, triton_launches = fake
    recorder = _WrapRecorder()
    monkeypatch.setattr(torch.library, "wrap_triton", recorder)
    with FakeTensorMode():
        x, y = torch.randn(64), torch.randn(64)
    return lm, kernel, triton_launches, recorder, x, y


def test_traced_launch_is_a_wrap_triton_node(traced):
    """Fake tensors (torch.compile tracing an inlined op): the launch becomes a `wrap_triton` call with the same
    arguments and warps; `enable_fp_fusion` is left to the compiler; nothing reaches Triton."""
    lm, kernel, triton_launches, recorder, x, y = traced
    lm.launch(kernel, (4,), x, y, 64, 0.5, BLOCK=16, num_warps=4, enable_fp_fusion=False)
    assert not triton_launches
    ((wrapped, grid, args, kwargs),) = recorder.calls
    assert wrapped is kernel and grid == (4,) and args == (x, y, 64, 0.5)
    assert kwargs == {"BLOCK": 16, "num_warps": 4}
    lm.launch(kernel, (4,), torch.randn(64), torch.randn(64), 64, 0.5, BLOCK=16)  # real tensors: Triton
    assert len(triton_launches) == 1 and len(recorder.calls) == 1


def test_traced_launch_refuses_one_tensor_written_twice(traced, monkeypatch):
    """One tensor passed as two arguments: traced only when at most one of them is written (functionalization
    hands each written argument its own clone back); with two written, a clear error, no graph."""
    lm, kernel, _, recorder, x, _ = traced
    monkeypatch.setattr(lm, "_written_arguments", lambda k, values: {"X", "Y"})
    with pytest.raises(RuntimeError, match=r"\['X', 'Y'\] are one tensor and more than one of them is written"):
        lm.launch(kernel, (4,), x, x, 64, 0.5, BLOCK=16)
    assert not recorder.calls
    monkeypatch.setattr(lm, "_written_arguments", lambda k, values: {"Y"})  # x read as X, updated in place as Y
    lm.launch(kernel, (4,), x, x, 64, 0.5, BLOCK=16)
    assert len(recorder.calls) == 1


def test_traced_launch_refuses_options_the_compiler_drops(traced):
    lm, kernel, _, recorder, x, y = traced
    with pytest.raises(RuntimeError, match=r"launch options \['maxnreg'\] cannot be traced"):
        lm.launch(kernel, (4,), x, y, 64, 0.5, BLOCK=16, maxnreg=128)
    assert not recorder.calls


@pytest.mark.gpu
def test_written_arguments_from_torchs_analysis():
    """torch's TTIR analysis (torch-private, two names across versions) finds what the kernel stores to."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import triton
    import triton.language as tl
    from hubfuse._common import launch

    @triton.jit
    def copy_scaled(X, OUT, UNUSED, n, STORE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(X + offs, mask=offs < n)
        if STORE:
            tl.store(UNUSED + offs, v, mask=offs < n)
        tl.store(OUT + offs, 2 * v, mask=offs < n)

    with FakeTensorMode():
        x, out = torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    values = dict(X=x, OUT=out, UNUSED=out, n=64, STORE=False, BLOCK=64)
    assert launch._written_arguments(copy_scaled, values) == {"OUT"}
    assert launch._written_arguments(copy_scaled, {**values, "STORE": True}) == {"OUT", "UNUSED"}


_AXPY = '''
import triton
import triton.language as tl


@triton.jit
def axpy(X, Y, OUT, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask)
    y = tl.load(Y + offs, mask=mask)
    tl.store(OUT + offs, alpha * x + y, mask=mask)
'''


@pytest.mark.gpu
@pytest.mark.parametrize("keying", ["native", "python"])
def test_cached_launches_compute_what_triton_launches_compute(tmp_path, keying):
    """On a GPU: every specialisation edge (n == 1, n % 16, misaligned views, dtypes) gives torch's result
    through the cached path (keyed by Triton's binder or in Python), and repeated launches do not go back
    through Triton."""
    import triton

    lm = _load_launch_module()
    lm.KEYING = keying
    (tmp_path / "axpy_kernel.py").write_text(_AXPY)
    spec = importlib.util.spec_from_file_location("axpy_kernel", tmp_path / "axpy_kernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert lm._fast_path
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 16, 17, 1000, 4096):
            for offset in (0, 1):
                base_x = torch.randn(n + offset, device="cuda", dtype=dtype)
                base_y = torch.randn(n + offset, device="cuda", dtype=dtype)
                x, y = base_x[offset:], base_y[offset:]
                for _ in range(3):
                    out = torch.full_like(x, float("nan"))
                    lm.launch(mod.axpy, (triton.cdiv(n, 128),), x, y, out, n, 0.5, BLOCK=128)
                    torch.testing.assert_close(out, (0.5 * x.float() + y.float()).to(dtype))
    assert len(mod.axpy.__dict__[lm._ATTR].compiled) >= 4 and lm.KEYING == keying
