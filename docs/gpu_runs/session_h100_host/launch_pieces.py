"""Host µs per call of the pieces of a Triton launch and of our ops, on the GPU host (no profiler)."""
import statistics, time, torch, triton
import hubfuse.rmsnorm as rn
import hubfuse.rmsnorm.triton_kernels as tk
from hubfuse._common import launch as L

dev = "cuda"
x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x); rstd = torch.empty(64, device=dev)

def bench(name, fn, n=3000):
    for _ in range(100): fn()
    torch.cuda.synchronize()
    ts = []
    for r in range(5):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    print(f"{name:48s} {statistics.median(ts):7.2f} us", flush=True)

kern = tk._rms_norm_fwd_kernel
bm, bn, nw = tk._fwd_config(1024)
args = (x, w, x, y, rstd, 64, 1024, x.stride(0), x.stride(0), y.stride(0), 1e-6)
kw = dict(MODE=0, ROUND_T=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
grid = (triton.cdiv(64, bm),)
bench("python no-op call", lambda: None)
bench("torch.empty 64x1024 bf16", lambda: torch.empty((64, 1024), dtype=torch.bfloat16, device=dev))
bench("torch.empty_like", lambda: torch.empty_like(x))
bench("x.add(1) (aten launch)", lambda: x.add(1))
bench("torch.mm 64x64", lambda: torch.mm(a, a))
bench("F.linear 64x1024 @ 1024x64", lambda: torch.nn.functional.linear(x, a.new_empty(64, 1024)))
bench("x.reshape(-1,1024).contiguous()", lambda: x.reshape(-1, 1024).contiguous())
bench("torch.cuda.current_device()", torch.cuda.current_device)
bench("_cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0))
bench("triton kernel[grid](...) (Triton's path)", lambda: kern[grid](*args, **kw))
bench("hubfuse launch(...)", lambda: L.launch(kern, grid, *args, **kw))
bench("  _native_bind only", lambda: L._native_bind(kern, 0, args, kw))
compiled = L._state(kern).compiled[next(iter(L._state(kern).compiled))]
vals, key = L._native_bind(kern, 0, args, kw)
def run_only():
    compiled.run(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(0), compiled.function, compiled.packed_metadata,
                 None, None, None, *vals)
bench("  compiled.run only", run_only)
lau = compiled.run
if hasattr(lau, "launch"):
    gs = None
    def c_only():
        lau.launch(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(0), compiled.function,
                   lau.launch_cooperative_grid, lau.launch_pdl, None, None, *vals)
    try:
        bench("  C launcher only (no scratch)", c_only)
    except Exception as e:
        print("C launcher direct failed:", type(e).__name__, e)
bench("rms_norm_fwd (triton_kernels, allocs)", lambda: tk.rms_norm_fwd(x, w, None, 1e-6, 0, torch.bfloat16))
bench("rms_norm op, no grad", lambda: rn.rms_norm(x, w, 1e-6))
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
bench("rms_norm op, requires grad (fwd)", lambda: rn.rms_norm(xg, wg, 1e-6))
dy = torch.randn_like(x)
def fb():
    rn.rms_norm(xg, wg, 1e-6).backward(dy)
bench("rms_norm op fwd+bwd", fb, n=1000)
def fb_t():
    torch.nn.functional.rms_norm(xg, (1024,), wg, 1e-6).backward(dy)
bench("torch F.rms_norm fwd+bwd (aten)", fb_t, n=1000)
class F1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a): return a.view_as(a)
    @staticmethod
    def backward(ctx, g): return g
bench("empty autograd.Function apply", lambda: F1.apply(xg))
print("--- backward pieces")
bench("direct tk.rms_norm_bwd (2 launches, allocs)", lambda: tk.rms_norm_bwd(dy, x, w, None, rstd, 0))
bench("grad(xg*2)  (engine, C++ node)", lambda: torch.autograd.grad(xg * 2, xg, dy), n=1000)
bench("grad(F1.apply(xg)) (engine, Python node)", lambda: torch.autograd.grad(F1.apply(xg), xg, dy), n=1000)
bench("grad(rms_norm op)", lambda: torch.autograd.grad(rn.rms_norm(xg, wg, 1e-6), (xg, wg), dy), n=1000)
bench("grad(F.rms_norm)", lambda: torch.autograd.grad(torch.nn.functional.rms_norm(xg, (1024,), wg, 1e-6), (xg, wg), dy), n=1000)
with torch.autograd.set_multithreading_enabled(False):
    bench("no-mt grad(xg*2)", lambda: torch.autograd.grad(xg * 2, xg, dy), n=1000)
    bench("no-mt grad(F1.apply(xg))", lambda: torch.autograd.grad(F1.apply(xg), xg, dy), n=1000)
    bench("no-mt grad(rms_norm op)", lambda: torch.autograd.grad(rn.rms_norm(xg, wg, 1e-6), (xg, wg), dy), n=1000)
    bench("no-mt grad(F.rms_norm)", lambda: torch.autograd.grad(torch.nn.functional.rms_norm(xg, (1024,), wg, 1e-6), (xg, wg), dy), n=1000)
def chain(k):
    h = xg
    for _ in range(k):
        h = F1.apply(h)
    return torch.autograd.grad(h, xg, dy)
bench("grad(20 chained Python nodes)", lambda: chain(20), n=300)
with torch.autograd.set_multithreading_enabled(False):
    bench("no-mt grad(20 chained Python nodes)", lambda: chain(20), n=300)
