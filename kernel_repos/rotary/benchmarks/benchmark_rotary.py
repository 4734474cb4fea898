"""`kernels benchmark` workloads for hubfuse/rotary (bf16 at the issue's shapes on GPU, fp32 small on CPU).

RoPE full and partial, forward and forward + backward, and the fused q/k RMSNorm + RoPE. `verify_*` returns
the HF-code result computed in float32, in the output's dtype (the CLI compares with torch.allclose(atol=1e-2),
which needs equal dtypes); cos/sin are real rotations and inputs are scaled so that outputs stay below ~1,
where one bf16 ulp (2**-7) is below that tolerance.
"""
import torch

from kernels.benchmark import Benchmark


def _dtype(device):
    return torch.bfloat16 if device != "cpu" else torch.float32


def _cos_sin(B, T, R, device, dtype):
    pos = torch.arange(T, device=device).float().expand(B, T)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, R, 2, device=device).float() / R))
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class _RopeWorkloads:  # not a Benchmark itself: the runner instantiates every Benchmark subclass in the file
    seed = 0
    shape = (32, 8, 128, 128)  # (Hq, Hk, D, R)

    def setup(self):
        Hq, Hk, D, R = self.shape
        B, T = (8, 2048) if self.device != "cpu" else (1, 8)
        dt = _dtype(self.device)
        self.q = (torch.randn(B, T, Hq, D, device=self.device, dtype=dt) * 0.25).transpose(1, 2).requires_grad_()
        self.k = (torch.randn(B, T, Hk, D, device=self.device, dtype=dt) * 0.25).transpose(1, 2).requires_grad_()
        self.cos, self.sin = _cos_sin(B, T, R, self.device, dt)
        self.dq = torch.randn_like(self.q) * 0.25
        self.dk = torch.randn_like(self.k) * 0.25

    def benchmark_forward(self):
        with torch.no_grad():
            self.out = torch.cat([t.flatten() for t in self.kernel.apply_rotary_pos_emb(self.q, self.k, self.cos, self.sin)])

    def verify_forward(self):
        f = lambda t: t.detach().float()
        q, k = self.kernel.apply_rotary_pos_emb_hf(f(self.q), f(self.k), f(self.cos), f(self.sin))
        return torch.cat([q.flatten(), k.flatten()]).to(self.q.dtype)

    def benchmark_forward_backward(self):
        q, k = self.kernel.apply_rotary_pos_emb(self.q, self.k, self.cos, self.sin)
        dq, dk = torch.autograd.grad((q, k), (self.q, self.k), (self.dq, self.dk))
        self.out = torch.cat([dq.flatten(), dk.flatten()])

    def verify_forward_backward(self):
        f = lambda t: t.detach().float().requires_grad_()
        q0, k0 = f(self.q), f(self.k)
        q, k = self.kernel.apply_rotary_pos_emb_hf(q0, k0, self.cos.float(), self.sin.float())
        dq, dk = torch.autograd.grad((q, k), (q0, k0), (self.dq.float(), self.dk.float()))
        return torch.cat([dq.flatten(), dk.flatten()]).to(self.q.dtype)


class RopeFullBenchmark(_RopeWorkloads, Benchmark):
    shape = (32, 8, 128, 128)


class RopePartialBenchmark(_RopeWorkloads, Benchmark):
    shape = (16, 2, 256, 64)


class QKNormRopeBenchmark(Benchmark):
    """Qwen3.5 shape: zero-centred q/k norm + partial RoPE, fused."""

    seed = 0

    def setup(self):
        Hq, Hk, D, R = 16, 2, 256, 64
        B, T = (8, 2048) if self.device != "cpu" else (1, 8)
        dt = _dtype(self.device)
        self.q = torch.randn(B, T, Hq, D, device=self.device, dtype=dt).requires_grad_()
        self.k = torch.randn(B, T, Hk, D, device=self.device, dtype=dt).requires_grad_()
        # zero-centred weights: the scale is 1 + w ~ 0.2, so outputs stay below ~1 (see the module docstring)
        self.wq = (torch.randn(D, device=self.device, dtype=dt) * 0.02 - 0.8).requires_grad_()
        self.wk = (torch.randn(D, device=self.device, dtype=dt) * 0.02 - 0.8).requires_grad_()
        self.cos, self.sin = _cos_sin(B, T, R, self.device, dt)

    def benchmark_forward(self):
        with torch.no_grad():
            q, k = self.kernel.qk_norm_rope_zero_centered(self.q, self.k, self.wq, self.wk, self.cos, self.sin)
            self.out = torch.cat([q.flatten(), k.flatten()])

    def verify_forward(self):
        f = lambda t: t.detach().float()
        q, k = self.kernel.qk_norm_rope_hf(f(self.q), f(self.k), f(self.wq), f(self.wk), f(self.cos), f(self.sin),
                                           1e-6, 2)
        return torch.cat([q.flatten(), k.flatten()]).to(self.q.dtype)
