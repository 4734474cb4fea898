"""Where the host time of our backward goes on the autograd device thread (mt) against the calling thread."""
import statistics, sys, time, tempfile
import torch
import hubfuse.rmsnorm as rn
import hubfuse.rmsnorm.ops as rops
import hubfuse.rmsnorm.triton_kernels as tk

dev = "cuda"
x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16)
w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_()
dy = torch.randn_like(x)
y = torch.empty_like(x); rstd = torch.empty(64, device=dev)

def bench(name, fn, n=800):
    out = []
    for mt in (True, False):
        with torch.autograd.set_multithreading_enabled(mt):
            for _ in range(50): fn()
            torch.cuda.synchronize()
            ts = []
            for r in range(5):
                t0 = time.perf_counter()
                for _ in range(n): fn()
                ts.append((time.perf_counter() - t0) / n * 1e6)
                torch.cuda.synchronize()
            out.append(statistics.median(ts))
    print(f"{name:52s} mt {out[0]:7.1f}  caller {out[1]:7.1f} us", flush=True)

def mk(body):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a): return a.view_as(a)
        @staticmethod
        def backward(ctx, g):
            body(); return g
    return Fn

bm, bn, nw = tk._fwd_config(1024)
args = (x, w, x, y, rstd, 64, 1024, x.stride(0), x.stride(0), y.stride(0), 1e-6)
kw = dict(MODE=0, ROUND_T=False, BLOCK_M=bm, BLOCK_N=bn, num_warps=nw)
tk.launch(tk._rms_norm_fwd_kernel, (64 // bm,), *args, **kw)
variants = {
    "bwd: nothing": lambda: None,
    "bwd: torch.empty_like": lambda: torch.empty_like(x),
    "bwd: x.add(1)": lambda: x.add(1),
    "bwd: 1 triton launch (hubfuse launch)": lambda: tk.launch(tk._rms_norm_fwd_kernel, (64 // bm,), *args, **kw),
    "bwd: 1 triton launch (Triton's kernel[grid])": lambda: tk._rms_norm_fwd_kernel[(64 // bm,)](*args, **kw),
    "bwd: 5 x.add(1)": lambda: [x.add(1) for _ in range(5)],
    "bwd: 5 triton launches": lambda: [tk.launch(tk._rms_norm_fwd_kernel, (64 // bm,), *args, **kw) for _ in range(5)],
    "bwd: tk.rms_norm_bwd": lambda: tk.rms_norm_bwd(dy, x, w, None, rstd, 0),
    "bwd: from-import + tk.rms_norm_bwd": lambda: rops._bwd_impl(dy, x, w, None, rstd, 0),
}
for name, body in variants.items():
    Fn = mk(body)
    bench(name, lambda: torch.autograd.grad(Fn.apply(xg), xg, dy))
bench("grad(rms_norm op)", lambda: torch.autograd.grad(rn.rms_norm(xg, wg, 1e-6), (xg, wg), dy))
bench("grad(F.rms_norm)", lambda: torch.autograd.grad(torch.nn.functional.rms_norm(xg, (1024,), wg, 1e-6), (xg, wg), dy))
# one decoder layer of the model (host_per_layer's setup), fwd + bwd, both threads alternated
sys.path.insert(0, "scripts")
import host_per_layer as h  # noqa: E402
import bench as b  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from hubfuse import presets  # noqa: E402
from tests.utils import load, register_local_kernels  # noqa: E402
register_local_kernels(*presets.kernel_repos("qwen3"))
cfg = b.slice_config("qwen3_0_6b", 1, smoke=False)
tmp = tempfile.mkdtemp()
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp)
model = load(tmp, presets.kernel_mapping("qwen3", revision=b.REVISION), dtype=torch.bfloat16, device=dev,
             attn_implementation="sdpa").train()
layer = model.model.layers[0]
hidden, kwargs = h.layer_inputs(model, 8, 1024, dev, torch.bfloat16)
h.time_layer(layer, hidden, kwargs, 5, dev)
res = {True: [], False: []}
for rnd in range(6):
    for mt in (True, False):
        with torch.autograd.set_multithreading_enabled(mt):
            res[mt].append(h.time_layer(layer, hidden, kwargs, 20, dev))
for mt in (True, False):
    f = statistics.median(r[0] for r in res[mt]); bw = statistics.median(r[1] for r in res[mt])
    print(f"decoder layer, backward on {'device thread' if mt else 'caller thread'}: fwd {f:.0f} bwd {bw:.0f} us")
