"""Host cost of one Triton launch, the same kernel and arguments three ways: Triton's `kernel[grid](...)`, and
hubfuse's cached launch (`_common.launch`) keyed by Triton's own binder ("native") or in Python. Kernels with few
arguments (RMSNorm forward) and many (the fused q/k norm + RoPE, ~45), on small inputs so that the GPU keeps up:
the rows time the host only (median of 5 runs of 2000 launches, GPU drained before each run)."""
import importlib
import statistics
import sys
import time

import torch

LAUNCHES = 2000


def _capture(pkg, call):
    """(kernel name -> (launch module, kernel, grid, args, kwargs)) of the launches one call of `call` makes."""
    tk = importlib.import_module(pkg.__name__ + ".triton_kernels")
    lm = sys.modules[tk.launch.__module__]  # the launch module the kernels use, wherever the build put it
    captured, original = {}, tk.launch

    def recording(kernel, grid, *args, **kwargs):
        captured.setdefault(kernel.fn.__name__, (lm, kernel, grid, args, kwargs))
        return original(kernel, grid, *args, **kwargs)

    tk.launch = recording
    try:
        call()
    finally:
        tk.launch = original
    return captured


def _host_us(fn) -> float:
    runs = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(LAUNCHES):
            fn()
        runs.append((time.perf_counter() - t0) / LAUNCHES * 1e6)
    torch.cuda.synchronize()
    return statistics.median(runs)


def run(h):
    dev, dt = h.dev, h.dt
    rms, rot = h.load_kernel("rmsnorm"), h.load_kernel("rotary")
    x, w = torch.randn(4, 256, device=dev, dtype=dt), torch.randn(256, device=dev, dtype=dt)
    q, k = torch.randn(1, 8, 4, 128, device=dev, dtype=dt), torch.randn(1, 8, 2, 128, device=dev, dtype=dt)
    cos, sin = torch.randn(1, 8, 128, device=dev, dtype=dt), torch.randn(1, 8, 128, device=dev, dtype=dt)
    wq, wk = torch.randn(128, device=dev, dtype=dt), torch.randn(128, device=dev, dtype=dt)
    calls = [(rms, lambda: rms.rms_norm(x, w)), (rot, lambda: rot.qk_norm_rope(q, k, wq, wk, cos, sin))]
    for pkg, call in calls:
        for _ in range(3):
            call()  # compile and cache
        for name, (lm, kernel, grid, args, kwargs) in _capture(pkg, call).items():
            note = f"{len(kernel.arg_names)} parameters"
            h.RESULTS.append(dict(op=f"launch {name}", impl="triton kernel[grid](...)", note=note,
                                  host_us=round(_host_us(lambda: kernel[grid](*args, **kwargs)), 2)))
            for keying in ("native", "python"):
                lm.KEYING = keying
                us = _host_us(lambda: lm.launch(kernel, grid, *args, **kwargs))
                h.RESULTS.append(dict(op=f"launch {name}", impl=f"hubfuse launch ({keying} key)", note=note,
                                      host_us=round(us, 2)))
            lm.KEYING = "native"
            for r in h.RESULTS[-3:]:
                print(r, flush=True)
