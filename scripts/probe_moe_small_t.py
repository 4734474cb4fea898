"""Probe (GPU): the MoE op at smaller token counts, where the host's launch work can set the pace. Exploratory,
not uploaded.

    python scripts/probe_moe_small_t.py [--tokens 1024 2048 4096 8192] [--rounds 30]

Qwen3-30B-A3B experts (E=128, top-8, H=2048, I=768, bf16), fwd+bwd through autograd, for each T: ours, HF
grouped_mm and torch.compile(HF grouped_mm) timed round-robin call by call (CUDA events, medians), and our host
time per step (the CPU time to enqueue one step while the GPU is held busy, probe_moe_overhead.host_ms).
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "kernel_repos/moe/torch-ext"))
sys.path.insert(0, str(ROOT / "kernel_repos/moe/benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_ops import round_robin_ms  # noqa: E402
from probe_moe_overhead import host_ms  # noqa: E402
from tune_moe import make_inputs  # noqa: E402

import moe  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args()
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    dev, dt = torch.device("cuda"), torch.bfloat16
    E, K, H, I = 128, 8, 2048, 768
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    ex = Qwen3MoeExperts(cfg).to(dev, dt)

    def hf(x, idx, w, gu, dn):
        return torch.func.functional_call(ex, {"gate_up_proj": gu, "down_proj": dn}, (x, idx, w))

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; E={E} K={K} H={H} I={I}", flush=True)
    for T in a.tokens:
        x, idx, w, gu, dn, dout = make_inputs(T, E, K, H, I, dev, dt)
        for t in (x, w, gu, dn):
            t.requires_grad_()
        inputs = (x, idx, w, gu, dn)

        def step(fn):
            for t in (x, w, gu, dn):
                t.grad = None
            fn(*inputs).backward(dout)

        fns = {"hubfuse": moe.moe_experts, "hf_grouped_mm": hf,
               "torch.compile(hf_grouped_mm)": torch.compile(hf, dynamic=False)}
        ms = round_robin_ms({k: (lambda f=f: step(f)) for k, f in fns.items()}, a.rounds)
        host = host_ms(lambda: step(moe.moe_experts))
        flops = 3 * T * K * (2 * H * 2 * I + 2 * I * H)
        line = ", ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in ms.items())
        print(f"T={T}: {line}; ours {ms['torch.compile(hf_grouped_mm)'] / ms['hubfuse']:.2f}x compile, "
              f"{ms['hf_grouped_mm'] / ms['hubfuse']:.2f}x HF grouped_mm; our host ms per step {host:.3f}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
