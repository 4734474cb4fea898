"""Probe (GPU): the routing sort with 16-bit keys (up to run 18) against 8-bit keys (E <= 254), timed alternately
call by call (CUDA events behind a sleep kernel, so they time GPU work, not launches; medians), and their results compared. Exploratory, not uploaded.

    python scripts/probe_moe_route.py [T E K]
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel_repos/moe/torch-ext"))
from moe import reference  # noqa: E402


def route_int16(top_k_index, num_experts):  # reference.route as of run 18
    keys = top_k_index.reshape(-1).clamp(-1, num_experts).to(torch.int16)
    sorted_ids, sorted_slot = torch.sort(keys, stable=True)
    bounds = torch.arange(num_experts + 1, device=keys.device, dtype=sorted_ids.dtype)
    return sorted_slot, torch.searchsorted(sorted_ids, bounds, out_int32=True)


def main():
    T, E, K = [int(v) for v in sys.argv[1:4]] if len(sys.argv) > 3 else (8192, 128, 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.topk(torch.randn(T, E, device="cuda", generator=g), K, dim=-1).indices
    fns = {"int16 keys": route_int16, "this tree": reference.route}
    outs = {name: fn(idx, E) for name, fn in fns.items()}
    same = all(torch.equal(a, b) for a, b in zip(outs["int16 keys"], outs["this tree"]))
    times = {name: [] for name in fns}
    for _ in range(5):
        for fn in fns.values():
            fn(idx, E)
    for _ in range(200):
        torch.cuda._sleep(1_000_000)  # the GPU busy while both calls are queued: the events time GPU work only
        for name, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(idx, E)
            e.record()
            times[name].append((s, e))
    torch.cuda.synchronize()
    med = {name: statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev) for name, ev in times.items()}
    print(f"route T={T} E={E} K={K}: " + ", ".join(f"{n} {v:.1f} us" for n, v in med.items())
          + f"; results equal: {same}")


if __name__ == "__main__":
    main()
