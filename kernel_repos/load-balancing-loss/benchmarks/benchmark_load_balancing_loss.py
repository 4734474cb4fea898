"""`kernels benchmark` workloads for hubfuse/load-balancing-loss (forward; the CLI times one call).

- aux loss over 48 layers x 8192 tokens x 128 experts, top-8, bf16 logits (CPU: 4 x 64 x 16, top-2);
  `verify` = transformers' `load_balancing_loss_func` (the reference copy shipped in this kernel).
- fused softmax-top-k router on 8192 x 128 bf16 logits, top-8, renormalised; `verify` = HF's router math.
"""
import torch

from kernels.benchmark import Benchmark


class LoadBalancingLossBenchmark(Benchmark):
    seed = 0

    def _shape(self):
        return (48, 8192, 128, 8) if self.device != "cpu" else (4, 64, 16, 2)

    def setup_aux_loss_bf16(self):
        L, T, E, K = self._shape()
        dt = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.E, self.K = E, K
        self.logits = tuple(torch.randn(T, E, device=self.device).to(dt) for _ in range(L))

    def benchmark_aux_loss_bf16(self):
        self.out = self.kernel.load_balancing_loss(self.logits, self.E, self.K)

    def verify_aux_loss_bf16(self):
        return self.kernel.load_balancing_loss_hf(self.logits, self.E, self.K)

    def setup_softmax_topk_bf16(self):
        _, T, E, K = self._shape()
        dt = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.K = K
        self.router_logits = torch.randn(T, E, device=self.device).to(dt)

    def benchmark_softmax_topk_bf16(self):
        self.out = self.kernel.softmax_topk(self.router_logits, self.K, True)[0]

    def verify_softmax_topk_bf16(self):
        p = torch.softmax(self.router_logits, dtype=torch.float, dim=-1)
        v, _ = torch.topk(p, self.K, dim=-1)
        return (v / v.sum(-1, keepdim=True)).to(self.router_logits.dtype)
