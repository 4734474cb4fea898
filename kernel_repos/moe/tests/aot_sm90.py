"""Compile every MoE Triton kernel for sm_90 (H100/H200) with the shipped GPU configs, without a GPU.

Run as a script with TRITON_INTERPRET unset and `hubfuse` importable (tests/test_moe.py does it
in a subprocess). Checks that each
kernel lowers to wgmma (Hopper tensor cores) with cp.async pipelining and fits in shared memory; prints
one line per kernel. Exits non-zero on the first failure.
"""
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hubfuse.moe import triton_kernels as tk

INTS = {"H", "I", "E", "T", "K", "TOP_K", "TWO_I", "TILES_N", "S", "M", "N", "MAX_TILES", "MAP_PROGRAMS"}
PTR_TYPES = {"SORTED_SLOT": "*i64", "TILE_EXPERT": "*i64", "TILE_START": "*i64", "OFFSETS": "*i32", "POS": "*i64",
             "IDX": "*i64", "DW_PART": "*fp32"}
SMEM_LIMIT = 227 * 1024


# the weight operand of the row-tiled kernels and its TMA block shape (BLOCK_N, BLOCK_K) or (BLOCK_K, BLOCK_N), or
# for gate_up_fwd (2, BLOCK_N, BLOCK_K): gate and up rows in one block (`_gate_up_operand`)
TMA_OPERAND = {"gate_up_fwd": ("W", "2NK"), "down_fwd": ("B", "NK"), "down_bwd_act": ("D", "KN"),
               "gate_up_bwd_x": ("B", "KN"), "down_bwd_g": ("B", "KN")}
# the contiguous sorted-row operand that TMA_A reads through a descriptor, block (BLOCK_M, BLOCK_K)
ROW_OPERAND = {"down_fwd": "A_ROWS", "gate_up_bwd_x": "A_ROWS", "down_bwd_act": "DOUT_OP", "down_bwd_g": "A_ROWS"}
HALF_TILE_KERNELS = ("gate_up_fwd", "down_fwd", "gate_up_bwd_x", "down_bwd_act", "down_bwd_g")


def check_ptx(name, k, tma):
    ptx = k.asm["ptx"]
    n_wgmma, n_cp = len(re.findall(r"wgmma\.mma_async", ptx)), len(re.findall(r"cp\.async", ptx))
    n_tma = len(re.findall(r"cp\.async\.bulk\.tensor", ptx))
    print(f"{name}{' (TMA)' if tma else ''}: shared={k.metadata.shared} wgmma={n_wgmma} cp.async={n_cp} tma={n_tma}")
    assert n_wgmma > 0, f"{name}: no wgmma instructions"
    assert n_cp > 0, f"{name}: no cp.async pipelining"
    assert n_tma > 0 or not tma, f"{name}: no TMA copies"
    assert k.metadata.shared <= SMEM_LIMIT, f"{name}: {k.metadata.shared} bytes of shared memory"


def compile_sm90(kern, constexprs, num_warps, num_stages, dtype="bf16", descs=None):
    names = kern.arg_names
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif descs and n in descs:
            sig[n] = descs[n]
        elif n in INTS or n.startswith("stride"):
            sig[n] = "i32"
        else:
            sig[n] = PTR_TYPES.get(n, "*" + dtype)
    # what the launcher specialises at the real shapes: pointers and dims/strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and not sig[n].startswith("tensordesc")}
    src = ASTSource(kern, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                             num_stages=num_stages))


def main():
    kernels = {
        "gate_up_fwd": tk._gate_up_fwd_kernel, "down_fwd": tk._rows_gemm_kernel,
        "down_bwd_act": tk._down_bwd_act_kernel, "gate_up_bwd_x": tk._rows_gemm_kernel,
        "down_bwd_g": tk._rows_gemm_kernel,
        "gate_up_bwd_w": tk._weight_grad_kernel, "down_bwd_w": tk._weight_grad_kernel,
    }
    fixed = {"gate_up_bwd_w": dict(A_BY_TOKEN=False), "down_bwd_w": dict(A_BY_TOKEN=True),  # per-use constexprs
             "down_fwd": dict(B_NK=True), "gate_up_bwd_x": dict(B_NK=False), "down_bwd_g": dict(B_NK=False),
             "down_bwd_act": dict(DOUT_SORTED=True)}  # dout gathered (grouped_mm_wgrad); by token: the fp32/fp16 pass
    for name, kern in kernels.items():
        # the shipped config, and for the row-tiled kernels also with the other TMA setting(s)
        shipped = tk.TUNING[name]
        variants = [{}]
        if name in TMA_OPERAND:
            variants.append({"TMA": not shipped["TMA"]})
        if name in ROW_OPERAND:
            variants.append({"TMA_A": not shipped["TMA_A"]})
        if name in HALF_TILE_KERNELS:  # the half-row-tile body beside the full one (with TMA_A where it has it)
            variants.append({"HALF_TILES": not shipped["HALF_TILES"], "TMA_A": True} if name in ROW_OPERAND
                            else {"HALF_TILES": not shipped["HALF_TILES"]})
        if name in HALF_TILE_KERNELS:  # the persistent launch (flattened tile loop)
            variants.append({"PERSISTENT": not shipped.get("PERSISTENT", False)})
        for over in variants:
            cfg = dict(shipped, **over)
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            even = {"EVEN_M": True, "EVEN_N": True} if name.endswith("_w") else {"EVEN_N": True, "EVEN_K": True}
            descs = {}
            if cfg.get("TMA"):
                arg, order = TMA_OPERAND[name]
                block = {"NK": (cfg["BLOCK_N"], cfg["BLOCK_K"]), "KN": (cfg["BLOCK_K"], cfg["BLOCK_N"]),
                         "2NK": (2, cfg["BLOCK_N"], cfg["BLOCK_K"])}[order]
                descs[arg] = f"tensordesc<bf16[{','.join(map(str, block))}]>"
            if cfg.get("TMA_A"):
                descs[ROW_OPERAND[name]] = f"tensordesc<bf16[{cfg['BLOCK_M']},{cfg['BLOCK_K']}]>"
            k = compile_sm90(kern, dict(cfg, PREC="tf32", **even, **fixed.get(name, {})), warps, stages, descs=descs)
            flags = "".join(f" ({flag})" for flag in ("TMA_A", "HALF_TILES", "PERSISTENT") if cfg.get(flag))
            check_ptx(name + flags, k, bool(descs))
    # fp32 inputs (IEEE dots) and fp16, odd dims (masked paths), with their configs
    for name, kern in kernels.items():
        for dtype, prec, cfg in (("fp32", "ieee", dict(tk._FP32_CONFIG, TMA=False, TMA_A=False)),
                                 ("fp16", "tf32", dict(tk.TUNING[name], TMA=False, TMA_A=False))):
            if name not in ROW_OPERAND:
                cfg.pop("TMA_A")
            cfg["HALF_TILES"] = name in HALF_TILE_KERNELS  # the masked paths of both bodies
            if name not in HALF_TILE_KERNELS:
                cfg.pop("HALF_TILES")
            else:
                cfg["PERSISTENT"] = False
            warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
            if name.endswith("_w"):
                cfg.pop("TMA")
            even = {"EVEN_M": False, "EVEN_N": False} if name.endswith("_w") else {"EVEN_N": False, "EVEN_K": False}
            per_use = dict(fixed.get(name, {}), **({"DOUT_SORTED": False} if name == "down_bwd_act" else {}))
            compile_sm90(kern, dict(cfg, PREC=prec, **even, **per_use), warps, stages, dtype=dtype)
        print(f"{name}: fp32 and fp16 (masked) ok")
    cfg = dict(tk.TUNING["combine"])
    for has_weight, refill in ((True, False), (False, True)):  # the forward's combine, the backward's (+ x rows)
        k = compile_sm90(tk._combine_kernel, dict(K=8, HAS_WEIGHT=has_weight, REFILL=refill, BLOCK_T=cfg["BLOCK_T"],
                                                  BLOCK_N=cfg["BLOCK_N"]), cfg["num_warps"], 1)
        print(f"combine{' (refill)' if refill else ''}: shared={k.metadata.shared}")
    cfg = dict(tk.TUNING["gather_rows"])  # the grouped_mm backward's row gather
    compile_sm90(tk._gather_rows_kernel, dict(BLOCK_R=cfg["BLOCK_R"], BLOCK_N=cfg["BLOCK_N"]), cfg["num_warps"], 1)
    print("gather_rows: ok")
    cfg = dict(tk.TUNING["swiglu_bwd_rows"])  # g_act's epilogue on the grouped_mm path
    k = compile_sm90(tk._swiglu_bwd_rows_kernel, dict(BLOCK_R=cfg["BLOCK_R"], BLOCK_N=cfg["BLOCK_N"]),
                     cfg["num_warps"], 1)
    print(f"swiglu_bwd_rows: shared={k.metadata.shared} ok")
    for block_e in (128, 512):  # the row-tile map + the sort's inversion (Qwen3-MoE and the largest expert count)
        compile_sm90(tk._tile_map_kernel, dict(BLOCK_M=128, BLOCK_E=block_e, BLOCK_J=max(16, 4096 // block_e),
                                               BLOCK_P=tk._POSITIONS_BLOCK), 4, 1)
    print("tile_map: ok")
    print("ok")


if __name__ == "__main__":
    main()
