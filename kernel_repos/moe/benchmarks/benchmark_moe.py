"""`kernels benchmark` workloads for hubfuse/moe: routed experts forward, Qwen3-MoE / Qwen3.5-MoE shapes, bf16.

Each workload times the forward of `moe_experts` (the CLI times one call); `verify_*` returns HF's
`grouped_mm`-equivalent torch result computed in fp32 (the CLI compares with allclose(atol=1e-2)).
"""
import torch
import torch.nn.functional as F

from kernels.benchmark import Benchmark


def _reference(x, idx, w, gu, dn):
    T, K = idx.shape
    E, two_i, H = gu.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        g, u = (x[tok].float() @ gu[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ dn[e].float().t()
        out.index_add_(0, tok, y * w[tok, slot, None].float())
    return out.to(x.dtype)


class MoEExpertsBenchmark(Benchmark):
    seed = 0

    def _make(self, T, H, E, K, I):
        dt = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.x = torch.randn(T, H, device=self.device, dtype=dt)
        logits = torch.randn(T, E, device=self.device)
        w, self.idx = torch.topk(logits.softmax(-1), K, dim=-1)
        self.w = (w / w.sum(-1, keepdim=True)).to(dt)
        # small weights keep outputs well under 1, where bf16 rounding stays far below the CLI's atol=1e-2
        self.gu = torch.randn(E, 2 * I, H, device=self.device, dtype=dt) * 0.01
        self.dn = torch.randn(E, H, I, device=self.device, dtype=dt) * 0.01

    def _shape(self, gpu_shape, cpu_shape):
        self._make(*(gpu_shape if self.device != "cpu" else cpu_shape))

    def _run(self):
        self.out = self.kernel.moe_experts(self.x, self.idx, self.w, self.gu, self.dn)

    def _verify(self):
        return _reference(self.x, self.idx, self.w, self.gu, self.dn)

    # one workload per model shape (T, H, E, K, I): the same call, other sizes
    def setup_qwen3_moe(self):
        self._shape((8192, 2048, 128, 8, 768), (64, 64, 8, 2, 32))

    def setup_qwen3_5_moe(self):
        self._shape((8192, 2048, 256, 8, 512), (64, 64, 16, 4, 32))

    benchmark_qwen3_moe = benchmark_qwen3_5_moe = _run
    verify_qwen3_moe = verify_qwen3_5_moe = _verify
