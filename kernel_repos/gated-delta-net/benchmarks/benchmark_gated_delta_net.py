"""`kernels benchmark` workloads for the gated delta rule and the causal conv1d: forward + backward, verified
against transformers' torch path (the reference also runs forward + backward).

Qwen3.5-MoE shapes on a GPU (bf16, 16 key / 32 value heads, head dims 128, batch 8 x 1024 tokens); tiny fp32
shapes on CPU. The CLI compares outputs with allclose(atol=1e-2): values are scaled to stay below ~1.

    kernels benchmark ./kernel_repos/gated-delta-net
"""
import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark


def _hf_chunk_rule(q, k, v, g, beta):
    """transformers' torch_chunk_gated_delta_rule (q, k repeated to the value heads), fp32 inside."""
    n_rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(n_rep, 2), k.repeat_interleave(n_rep, 2)
    dtype, (B, T, H, K), V = q.dtype, q.shape, v.shape[-1]
    q, k, v, beta, g = [x.transpose(1, 2).float() for x in (q, k, v, beta, g)]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    C = 64
    pad = (C - T % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (T + pad) // C
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (x.reshape(B, H, n, C, -1) for x in (q, k, kb, vb))
    g = g.reshape(B, H, n, C).cumsum(-1)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (kb @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * g.exp()[..., None], upper=False, unitriangular=True)
    state = q.new_zeros(B, H, K, V)
    q, k = q * g.exp()[..., None], k * (g[..., -1:] - g).exp()[..., None]
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * g[:, :, i, -1].exp()[..., None, None] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, 2).reshape(B, H, -1, V)[:, :, :T].transpose(1, 2).to(dtype)


def _hf_conv_silu(x, w):
    """transformers' causal_conv1d_fn + SiLU on channels-last x (B, S, C)."""
    S = x.shape[1]
    out = F.conv1d(x.transpose(1, 2).to(w.dtype), w.unsqueeze(1), padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(out[..., :S]).to(x.dtype).transpose(1, 2)


class GatedDeltaNetBenchmark(Benchmark):
    seed = 0

    def setup(self):
        gpu = self.device == "cuda"
        B, T, H, HV, D = (8, 1024, 16, 32, 128) if gpu else (1, 100, 1, 2, 16)
        dtype = torch.bfloat16 if gpu else torch.float32
        dev = self.device
        self.q = torch.randn(B, T, H, D, device=dev, dtype=dtype, requires_grad=True)
        self.k = torch.randn(B, T, H, D, device=dev, dtype=dtype, requires_grad=True)
        self.v = (torch.randn(B, T, HV, D, device=dev, dtype=dtype) * 0.1).requires_grad_()
        self.g = F.logsigmoid(torch.randn(B, T, HV, device=dev) + 3.0).requires_grad_()
        self.beta = torch.sigmoid(torch.randn(B, T, HV, device=dev)).to(dtype).requires_grad_()
        self.do = torch.randn(B, T, HV, D, device=dev, dtype=dtype)
        C = 2 * H * D + HV * D
        self.x = torch.randn(B, T, C, device=dev, dtype=dtype, requires_grad=True)
        self.w = (torch.randn(C, 4, device=dev, dtype=dtype) * 0.3).requires_grad_()
        self.dx = torch.randn(B, T, C, device=dev, dtype=dtype) * 0.1

    @staticmethod
    def _backward(y, dy):
        """Runs y's backward (workloads and references are timed forward + backward) and returns y's value."""
        y.backward(dy)
        return y.detach()

    def _reference(self, fn, dy, *inputs):
        return self._backward(fn(*[t.detach().requires_grad_() for t in inputs]), dy)

    def benchmark_chunk_gated_delta_rule(self):
        o, _ = self.kernel.chunk_gated_delta_rule(self.q, self.k, self.v, self.g, self.beta,
                                                  use_qk_l2norm_in_kernel=True)
        self.out = self._backward(o, self.do)

    def verify_chunk_gated_delta_rule(self):
        return self._reference(_hf_chunk_rule, self.do, self.q, self.k, self.v, self.g, self.beta)

    def benchmark_causal_conv1d_silu(self):
        self.out = self._backward(self.kernel.causal_conv1d(self.x, self.w, None, "silu"), self.dx)

    def verify_causal_conv1d_silu(self):
        return self._reference(_hf_conv_silu, self.dx, self.x, self.w)
