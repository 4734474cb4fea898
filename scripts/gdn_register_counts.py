#!/usr/bin/env python
"""Registers and spills a thread of the Gated DeltaNet gradient kernel on Hopper, without a GPU.

    python scripts/gdn_register_counts.py                          # 8 warps / 3 stages and 4 warps / 2 stages
    python scripts/gdn_register_counts.py --settings 8,3 4,2 16,3 --block-v 64

Compiles `_grads_kernel` for sm_90 (no GPU needed: Triton's own ptxas, its log) as the `layer` workload of
scripts/sweep_gated_delta_net.py launches it: bf16, head dims 128, 16 key / 32 value heads, the gates a, b, the
l2norm in the kernel, every size a multiple of 16, the launch over full 64-row chunks (`CHUNKS=1`). One line per
(part, warps, stages): the one kernel (`_grads_kernel`) and its two halves (`_grads_dq_kernel`, `_grads_dk_kernel`:
`CONFIG["grads"]["split"] = 1`). The counts come from this Triton's compiler; the GPU's timing decides a setting.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile, not interpret
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas's -v log
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # (a cached kernel prints none)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hubfuse.gated_delta_net import triton_chunk  # noqa: E402

PARTS = {"_grads_kernel": (True, True), "_grads_dq_kernel": (True, False), "_grads_dk_kernel": (False, True)}
INTS = {"T", "NT", "HV", "K", "V"}
FP32_POINTERS = {"GC", "DQP", "DKP", "DA_LOG_PART", "DDT_PART", "DGC_PART"}  # the rest: bf16 tensors


def ptxas_counts(dq_side: bool, dk_side: bool, num_warps: int, num_stages: int, block_v: int) -> str:
    """ptxas's registers / spill line for one specialisation (every pointer and int 16-divisible, as at real
    sizes)."""
    fn = triton_chunk._grads_kernel
    constexprs = dict(GROUP=2, BK=128, BV=block_v, L2NORM=True, GATE=True, ROUND_BETA=True, VARLEN=False,
                      IEEE=False, DQ_SIDE=dq_side, DK_SIDE=dk_side, CHUNKS=1)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name == "scale":
            signature[name] = "fp32"
            continue
        is_int = name in INTS or name.startswith("stride")
        signature[name] = "i32" if is_int else "*fp32" if name in FP32_POINTERS else "*bf16"
        attrs[(i,)] = [["tt.divisibility", 16]]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    used = re.findall(r"Used \d+ registers", log.getvalue())
    spills = re.findall(r"\d+ bytes spill stores, \d+ bytes spill loads", log.getvalue())
    return f"{used[-1] if used else '?'}, {spills[-1] if spills else 'no spill line'}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=["8,3", "4,2"], help="num_warps,num_stages pairs")
    p.add_argument("--block-v", type=int, default=triton_chunk.CONFIG["grads_dk"]["block_v"])
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    args = p.parse_args(argv)
    for setting in args.settings:
        num_warps, num_stages = (int(x) for x in setting.split(","))
        for part in args.parts:
            counts = ptxas_counts(*PARTS[part], num_warps, num_stages, args.block_v)
            print(f"{part:17s} warps {num_warps:2d} stages {num_stages} block_v {args.block_v}: {counts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
