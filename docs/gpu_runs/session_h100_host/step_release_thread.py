"""Qwen3-0.6B plain hubfuse step: releases on/off x backward on the device thread / on the calling thread,
alternated in one process; median step and host (enqueue, GPU drained) ms."""
import statistics, sys, time, types
from pathlib import Path
sys.path.insert(0, "scripts")
import bench  # noqa: E402
import torch  # noqa: E402
from hubfuse import presets  # noqa: E402
from tests.utils import register_local_kernels  # noqa: E402

register_local_kernels(*presets.kernel_repos("qwen3"))
DEV = "cuda" if torch.cuda.is_available() else "cpu"
args = types.SimpleNamespace(smoke=DEV == "cpu", layers=None, batch=None, seq=None)
name = "qwen3_0_6b"
path = Path("/tmp/hubfuse_dense_models" + ("_cpu" if DEV == "cpu" else "")) / name
bench.ensure_model(name, path, args, DEV)
model, _, _ = bench.load_model(name, "ours", path, DEV)
layers, B, S = bench.shape_of(name, args)
cfg = bench.slice_config(name, layers, DEV == "cpu")
g = torch.Generator().manual_seed(1)
batches = []
for _ in range(4):
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g).to(DEV)
    batches.append({"input_ids": ids, "labels": ids})
step, opt = bench.make_step(model, "ours", DEV, batches[0])
def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


mods = [m for n, m in list(sys.modules.items()) if n.endswith(".layers") and "_release" in vars(m) and "_attention_forward" in vars(m)]
print("rotary layer modules patched:", [m.__name__ for m in mods])
originals = [m._release for m in mods]

def set_release(on):
    for m, f in zip(mods, originals):
        m._release = f if on else (lambda *a, **k: None)

res = {}
for rnd in range(4):
    for release in (True, False):
        for mt in (True, False):
            set_release(release)
            key = f"release={'on ' if release else 'off'} backward_thread={'device' if mt else 'caller'}"
            with torch.autograd.set_multithreading_enabled(mt):
                for i in range(3):
                    step(batches[i % 4])
                sync()
                for i in range(6):
                    sync()
                    t0 = time.perf_counter()
                    step(batches[i % 4])
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    res.setdefault(key, ([], []))
                    res[key][0].append((t2 - t0) * 1e3)
                    res[key][1].append((t1 - t0) * 1e3)
                # back to back: 6 steps, one sync
                sync(); t0 = time.perf_counter()
                for i in range(6):
                    step(batches[i % 4])
                sync()
                res.setdefault(key + " b2b", ([], []))[0].append((time.perf_counter() - t0) / 6 * 1e3)
for key, (steps, hosts) in res.items():
    h = f" host {statistics.median(hosts):7.1f}" if hosts else ""
    print(f"{key:48s} step {statistics.median(steps):7.1f} ms{h}  (n={len(steps)}, min {min(steps):.1f})")
if DEV == "cuda":
    print("peak GiB", round(torch.cuda.max_memory_allocated() / 2**30, 2))
