"""Triton launches with little host work (vendored into every hub variant; imports triton).

`launch(kernel, grid, *args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does. Triton's own launch
re-binds the arguments, formats its cache key as a string, builds launch metadata and calls its (empty) launch
hooks on every call. Here the first launch of each specialisation goes through Triton (which compiles or finds
the kernel and returns it); later launches with the same specialisation call that compiled kernel's launcher
directly, with the argument list Triton would have passed.

The cache key is the specialisation Triton's own binder computes (native code) plus the launch options and the
device. Where that binder is not available (another Triton), a Python key holds everything Triton specialises
on: per tensor its dtype and whether its address is 16-byte aligned; per integer whether it is 1, whether it is
a multiple of 16 and whether it fits in 32 bits; per tensor descriptor its dtype, block shape, padding and the
same for its shape and strides; the constexpr values; the launch options. Keying on more than Triton does only
costs an extra trip through Triton's path. Launch hooks (a profiler's), ROCm, the interpreter and argument
types the Python key does not know take Triton's own path, as does a Triton whose compiled kernels do not take
this launch signature (checked once).

A kernel whose first launch fails for want of shared memory (`OutOfResources`: its pipelined loads do not fit
the GPU, e.g. fp32 tiles at head dim 128 with the stages tuned for 16-bit ones) is compiled again with one stage
fewer, down to one; the fast path then keeps that kernel under the original settings' key. The failure comes
from loading the compiled kernel, before anything runs.

Traced (an op's implementation inlined by torch.compile, `_common.custom_op`: its tensors are fake), a launch is
`torch.library.wrap_triton(kernel)[grid](...)`, a graph node Inductor compiles and launches itself.

`cdiv` and `next_power_of_2` are Triton's for host code, without the constexpr-function wrapper.
"""
import torch
import triton
from torch._subclasses.fake_tensor import is_fake  # torch-private: no public "is this tensor fake"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_MISSING = object()
_ATTR = "_hubfuse_launch_state"
_fast_path = torch.version.cuda is not None and getattr(torch.version, "hip", None) is None


class _Unkeyable(Exception):
    pass


def _int_key(value: int):
    return value == 1, value % 16 == 0, _INT32_MIN <= value <= _INT32_MAX


class _LaunchState:
    """Per-kernel parameter layout (names, constexpr flags, defaults) and the compiled-kernel cache."""

    __slots__ = ("names", "constexpr", "defaults", "position", "compiled")

    def __init__(self, kernel):
        params = kernel.params
        self.names = tuple(p.name for p in params)
        self.constexpr = tuple(bool(p.is_constexpr) for p in params)
        self.defaults = tuple(p.default if p.has_default else _MISSING for p in params)
        self.position = {name: i for i, name in enumerate(self.names)}
        self.compiled = {}

    def bind(self, args, kwargs):
        """(every parameter's value in signature order, the launch options as a sorted tuple)."""
        if len(args) == len(self.names) and not kwargs:
            return args, ()
        values = list(args) + [_MISSING] * (len(self.names) - len(args))
        options = []
        for name, value in kwargs.items():
            i = self.position.get(name)
            if i is None:
                options.append((name, value))
            else:
                values[i] = value
        for i, value in enumerate(values):
            if value is _MISSING:
                if self.defaults[i] is _MISSING:
                    raise TypeError(f"launch: missing argument {self.names[i]!r}")
                values[i] = self.defaults[i]
        options.sort(key=lambda item: item[0])
        return values, tuple(options)

    def key(self, values, options, device_index):
        key = [device_index, options]
        for value, is_constexpr in zip(values, self.constexpr):
            if is_constexpr:
                key.append(value)
            elif isinstance(value, torch.Tensor):
                key.append((value.dtype, value.data_ptr() % 16 == 0))
            elif type(value) is int:
                key.append(_int_key(value))
            elif type(value) is float:
                key.append(float)
            elif value is None or type(value) is bool:
                key.append(value)
            elif type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor
                key.append((value.base.dtype, tuple(value.block_shape), value.padding,
                            tuple(_int_key(n) for n in (*value.shape, *value.strides))))
            else:
                raise _Unkeyable
        return tuple(key)


def _state(kernel):
    state = kernel.__dict__.get(_ATTR)
    if state is None:
        state = _LaunchState(kernel)
        setattr(kernel, _ATTR, state)
    return state


def _hook_active(hook) -> bool:
    # Triton >= 3.5 keeps a HookChain (empty unless a profiler added a hook); older ones None or a function
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code (Triton's is a constexpr function: a few microseconds a call)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (0 for 0, as Triton's)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _native_bind(kernel, device_index, args, kwargs):
    """(parameter values in order, cache key) from Triton's own binder (native code in Triton >= 3.5): the
    specialisation Triton itself would compute, without its cache-key string and launch-metadata objects. None
    until Triton has bound this kernel once on this device."""
    caches = kernel.device_caches.get(device_index)
    if caches is None:
        return None
    bound, specialization, options = caches[-1](*args, **kwargs)
    return tuple(bound.values()), (device_index, tuple(specialization), tuple(options.items()))


# how launches are keyed: "native" (Triton's binder), "python" (_LaunchState.key); benchmarks flip it
KEYING = "native"
_DEFAULT_STAGES = 3  # Triton's num_stages where a launch does not set it


def _triton_launch(kernel, grid, args, kwargs):
    """`kernel[grid](*args, **kwargs)`, again with one pipeline stage fewer while the kernel does not fit the GPU's
    shared memory (Triton raises OutOfResources when it loads the compiled kernel, before launching it)."""
    try:
        return kernel[grid](*args, **kwargs)
    except triton.runtime.errors.OutOfResources:
        stages = kwargs.get("num_stages", _DEFAULT_STAGES)
        if stages <= 1:
            raise
        return _triton_launch(kernel, grid, args, {**kwargs, "num_stages": stages - 1})


def _traced(args) -> bool:
    """Whether the launch's first tensor is fake (functional or fake tensors: a graph is being traced)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return type(a) is not torch.Tensor and is_fake(a)
    return False


def _written_arguments(kernel, values) -> set:
    """The arguments torch's analysis of the kernel's TTIR finds written (torch-private: `identify_mutated_tensors`
    up to torch 2.12, `identify_accessed_tensors` since)."""
    from torch._higher_order_ops import triton_kernel_wrap
    from torch._subclasses.functional_tensor import FunctionalTensor

    # the analysis takes fake tensors, as functionalization hands them to it
    values = {name: (v.from_functional() if isinstance(v, FunctionalTensor) else v) for name, v in values.items()}
    accessed = getattr(triton_kernel_wrap, "identify_accessed_tensors", None)
    if accessed is not None:
        return {dep.name for dep in accessed(kernel, values, {}).read_writes.writes}
    return set(triton_kernel_wrap.identify_mutated_tensors(kernel, values, {}))


def _traced_launch(kernel, grid, args, kwargs):
    """The launch as a `wrap_triton` node. Functionalization clones each tensor the kernel writes and hands the
    clone back for that argument, so one tensor passed as two arguments (a placeholder for an output not
    written, or an in-place update) is only right when at most one of them is written: checked here, from the
    writes torch's own analysis of the kernel finds (it reports every argument when it cannot tell)."""
    values = dict(zip(kernel.arg_names, args))
    values.update((name, value) for name, value in kwargs.items() if name in kernel.arg_names)
    by_tensor = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            by_tensor.setdefault(id(value), []).append(name)
    shared = [names for names in by_tensor.values() if len(names) > 1]
    if shared:
        written = _written_arguments(kernel, values)
        for names in shared:
            if len(written.intersection(names)) > 1:
                raise RuntimeError(
                    f"{kernel.fn.__name__}: arguments {names} are one tensor and more than one of them is written; "
                    "it cannot be traced (run with HUBFUSE_INLINE_OPS=0)")
    options = {name: value for name, value in kwargs.items() if name not in kernel.arg_names}
    unknown = set(options) - _TRACED_OPTIONS - {"enable_fp_fusion"}
    if unknown:
        raise RuntimeError(f"{kernel.fn.__name__}: launch options {sorted(unknown)} cannot be traced "
                           "(run with HUBFUSE_INLINE_OPS=0)")
    # Inductor compiles the kernel with its own floating-point contraction setting, as for its own kernels
    kwargs = {name: value for name, value in kwargs.items() if name != "enable_fp_fusion"}
    return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


_TRACED_OPTIONS = {"num_warps", "num_stages"}  # launch options a wrap_triton node passes on to the compiler


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)` through the compiled kernel's own launcher once it is known; a
    `wrap_triton` node when traced."""
    global _fast_path, KEYING
    if _traced(args):
        return _traced_launch(kernel, grid, args, kwargs)
    if not _fast_path or not isinstance(kernel, triton.runtime.jit.JITFunction) or _hooks_set():
        return _triton_launch(kernel, grid, args, kwargs)
    state = _state(kernel)
    device_index = torch.cuda.current_device()
    bound = None
    if KEYING == "native":
        try:
            bound = _native_bind(kernel, device_index, args, kwargs)
        except Exception:  # noqa: BLE001 - another Triton's internals: key in Python from now on
            KEYING = "python"
    if bound is not None:
        values, key = bound
    else:
        values, options = state.bind(args, kwargs)
        try:
            key = state.key(values, options, device_index)
        except _Unkeyable:
            return _triton_launch(kernel, grid, args, kwargs)
    compiled = state.compiled.get(key)
    if compiled is None:
        compiled = _triton_launch(kernel, grid, args, kwargs)
        if hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
            state.compiled[key] = compiled
        return compiled
    if callable(grid):
        grid = grid(dict(zip(state.names, values), **kwargs))
    n = len(grid)
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    try:
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *values)
    except TypeError:
        # this Triton's launcher takes other arguments: use Triton's own path from now on
        _fast_path = False
        return _triton_launch(kernel, grid, args, kwargs)
    return compiled
