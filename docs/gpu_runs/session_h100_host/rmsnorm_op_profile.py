import time, statistics, cProfile, pstats, io
import torch
import hubfuse.rmsnorm as rn, hubfuse.rmsnorm.triton_kernels as tk
torch.autograd.set_multithreading_enabled(False)
x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda"); w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_(); dy = torch.randn_like(x)
f = lambda: torch.autograd.grad(rn.rms_norm(xg, wg, 1e-6), (xg, wg), dy)
def bench(name, fn, n=1000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); ts=[]
    for r in range(5):
        t0=time.perf_counter()
        for _ in range(n): fn()
        ts.append((time.perf_counter()-t0)/n*1e6); torch.cuda.synchronize()
    print(f"{name:40s} {statistics.median(ts):7.1f} us", flush=True)
bench("grad(rms_norm op), caller thread", f)
bench("grad(F.rms_norm), caller thread", lambda: torch.autograd.grad(torch.nn.functional.rms_norm(xg, (1024,), wg, 1e-6), (xg, wg), dy))
for sort in ("tottime", "cumulative"):
    pr = cProfile.Profile(); pr.enable()
    for _ in range(1000): f()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(30); print(s.getvalue()[:7000])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(100): f()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
orig = tk.launch
tk.launch = lambda *a, **k: None
bench("grad(rms_norm op), no-op triton launches", f)
tk.launch = orig
