"""`kernels benchmark` workloads for hubfuse/swiglu (bf16 at the issue's shapes on GPU, fp32 small on CPU).

Activation (forward, and forward + backward returning `dgate_up`), the MLP block and the RMSNorm + MLP fusion
(forward). `verify_*` returns the HF-formula result in the output's dtype (the CLI compares with
torch.allclose(atol=1e-2), which needs equal dtypes); inputs are scaled so outputs stay below ~1, where one bf16
ulp (2**-7) is below that tolerance.
"""
import torch
import torch.nn.functional as F

from kernels.benchmark import Benchmark


def _dtype(device):
    return torch.bfloat16 if device != "cpu" else torch.float32


class SwiGLUActivationBenchmark(Benchmark):
    seed = 0

    def setup(self):
        N, I = (16384, 12288) if self.device != "cpu" else (64, 96)
        dt = _dtype(self.device)
        self.gate_up = (torch.randn(N, 2 * I, device=self.device, dtype=dt) * 0.25).requires_grad_()
        self.dh = torch.randn(N, I, device=self.device, dtype=dt) * 0.25

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = self.kernel.swiglu(self.gate_up)

    def verify_forward(self):
        gate, up = self.gate_up.detach().float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(self.gate_up.dtype)

    def benchmark_forward_backward(self):
        h = self.kernel.swiglu(self.gate_up)
        (self.out,) = torch.autograd.grad(h, self.gate_up, self.dh)

    def verify_forward_backward(self):
        gate_up = self.gate_up.detach().float().requires_grad_()
        (grad,) = torch.autograd.grad(self.kernel.swiglu_hf(gate_up), gate_up, self.dh.float())
        return grad.to(self.gate_up.dtype)


class SwiGLUMLPBenchmark(Benchmark):
    seed = 0

    def setup(self):
        N, H, I = (16384, 4096, 12288) if self.device != "cpu" else (64, 32, 48)
        dt = _dtype(self.device)
        self.x = torch.randn(N, H, device=self.device, dtype=dt) * 0.25
        self.gate_up_weight = torch.randn(2 * I, H, device=self.device, dtype=dt) * H**-0.5
        self.down_weight = torch.randn(H, I, device=self.device, dtype=dt) * I**-0.5
        self.norm_weight = 0.25 + 0.02 * torch.randn(H, device=self.device, dtype=dt)

    def benchmark_mlp(self):
        with torch.no_grad():
            self.out = self.kernel.swiglu_mlp(self.x, self.gate_up_weight, self.down_weight)

    def verify_mlp(self):
        return self.kernel.swiglu_mlp_hf(self.x, self.gate_up_weight, self.down_weight)

    def benchmark_rms_norm_mlp(self):
        with torch.no_grad():
            self.out = self.kernel.rms_norm_swiglu_mlp(self.x, self.norm_weight, 1e-6, self.gate_up_weight,
                                                       self.down_weight)

    def verify_rms_norm_mlp(self):
        normed = self.kernel.rmsnorm.rms_norm_hf(self.x, self.norm_weight, 1e-6)  # the rmsnorm package it carries
        return self.kernel.swiglu_mlp_hf(normed, self.gate_up_weight, self.down_weight)
