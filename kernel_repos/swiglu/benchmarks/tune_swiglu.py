"""Launch-config sweep for the SwiGLU activation kernels on one GPU (bf16, default 16384 x 12288).

    python kernel_repos/swiglu/benchmarks/tune_swiglu.py [M I]

Times the forward, the activation backward (dgate_up to a new buffer) and the MLP-style in-place backward
(dgate_up over gate_up, h over dh) for a short list of (BLOCK_M, BLOCK_N, num_warps), checks each result
against the default config, and prints the times beside the bandwidth floor (bytes / measured copy rate).
Paste the winner into `_launch_shape` in triton_kernels.py. Not uploaded (only benchmark*.py is).
"""
import importlib
import sys
from pathlib import Path

import torch
import triton
from kernels import get_local_kernel

# the built repo, as users load it (run `python scripts/build.py swiglu` first)
swiglu = get_local_kernel(Path(__file__).resolve().parents[1])
tk = importlib.import_module(swiglu.__name__ + ".triton_kernels")

CANDIDATES = [None, (1, 1024, 4), (1, 2048, 8), (2, 2048, 8), (1, 4096, 8), (1, 4096, 16), (4, 1024, 8),
              (2, 1024, 4), (8, 512, 8), (1, 8192, 16), (4, 2048, 16)]


def main():
    M, I = (int(a) for a in sys.argv[1:3]) if len(sys.argv) >= 3 else (16384, 12288)
    dev, dt = "cuda", torch.bfloat16
    a = torch.empty(2 * 1024**3 // 2, dtype=dt, device=dev)
    b = torch.empty_like(a)
    copy_bw = 4 * a.numel() / (triton.testing.do_bench(lambda: b.copy_(a), return_mode="median") * 1e-3)
    del a, b
    gate_up = torch.randn(M, 2 * I, dtype=dt, device=dev)
    dh = torch.randn(M, I, dtype=dt, device=dev)
    ref_h = tk.swiglu_fwd(gate_up)
    ref_dgu = torch.empty_like(gate_up)
    tk.swiglu_bwd(dh, gate_up, ref_dgu)
    floors = {"fwd": 3 * M * I * 2 / copy_bw * 1e3, "bwd": 5 * M * I * 2 / copy_bw * 1e3,
              "bwd_inplace+h": 6 * M * I * 2 / copy_bw * 1e3}
    print(f"M={M} I={I} bf16, copy {copy_bw / 1e12:.2f} TB/s; floors ms: "
          + ", ".join(f"{k} {v:.3f}" for k, v in floors.items()))
    scratch_gu, scratch_dh, dgu = gate_up.clone(), dh.clone(), torch.empty_like(gate_up)
    rows = []
    for cfg in CANDIDATES:
        try:
            h = tk.swiglu_fwd(gate_up, cfg)
            tk.swiglu_bwd(dh, gate_up, dgu, config=cfg)
            ok = torch.equal(h, ref_h) and torch.equal(dgu, ref_dgu)
            t_fwd = triton.testing.do_bench(lambda: tk.swiglu_fwd(gate_up, cfg), return_mode="median")
            t_bwd = triton.testing.do_bench(lambda: tk.swiglu_bwd(dh, gate_up, dgu, config=cfg), return_mode="median")
            # in place on scratch copies (values become garbage after the first call: timing only)
            t_inp = triton.testing.do_bench(
                lambda: tk.swiglu_bwd(scratch_dh, scratch_gu, scratch_gu, h=scratch_dh, config=cfg),
                return_mode="median")
            rows.append((t_fwd + t_bwd, cfg, t_fwd, t_bwd, t_inp, ok))
        except Exception as e:  # a config that does not compile / fit
            print(f"{cfg}: {type(e).__name__}: {str(e)[:120]}")
    print(f"{'config (BM, BN, warps)':24s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd+bwd':>8s} {'floor/x':>8s} "
          f"{'inplace':>8s} ok")
    total_floor = floors["fwd"] + floors["bwd"]
    for total, cfg, t_fwd, t_bwd, t_inp, ok in sorted(rows, key=lambda r: r[0]):
        name = "default " + str(tk._launch_shape(M, I)[1:]) if cfg is None else str(cfg)
        print(f"{name:24s} {t_fwd:8.3f} {t_bwd:8.3f} {total:8.3f} {total_floor / total:8.2f} {t_inp:8.3f} {ok}")


if __name__ == "__main__":
    main()
