"""`kernels benchmark` workloads for the RMSNorm family: forward + backward, verified against HF eager.

The CLI compares outputs with torch.allclose(atol=1e-2): weights and gates are scaled so that outputs stay
below ~1, where one bf16 ulp (2**-7) is below that tolerance.

    kernels benchmark ./kernel_repos/rmsnorm     (on a GPU; small shapes on CPU)
"""
import torch
from kernels.benchmark import Benchmark


class RMSNormBenchmark(Benchmark):
    seed = 0

    def setup(self):
        rows, hidden = (16384, 4096) if self.device == "cuda" else (64, 256)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.x = torch.randn(rows, hidden, device=self.device, dtype=dtype, requires_grad=True)
        self.w = (torch.randn(hidden, device=self.device, dtype=dtype) * 0.02 + 0.2).requires_grad_()
        self.wz = (torch.randn(hidden, device=self.device, dtype=dtype) * 0.02 - 0.8).requires_grad_()  # 1 + w
        self.dy = torch.randn(rows, hidden, device=self.device, dtype=dtype)
        rows_g = rows * 32 if self.device == "cuda" else 512
        self.xg = torch.randn(rows_g, 128, device=self.device, dtype=dtype, requires_grad=True)
        self.g = (torch.randn(rows_g, 128, device=self.device, dtype=dtype) * 0.25).requires_grad_()
        self.wg = (torch.randn(128, device=self.device, dtype=dtype) * 0.02 + 0.2).requires_grad_()
        self.dyg = torch.randn(rows_g, 128, device=self.device, dtype=dtype)

    def _fwd_bwd(self, y, dy):
        y.backward(dy)
        self.out = y.detach()

    def benchmark_rms_norm(self):
        self._fwd_bwd(self.kernel.rms_norm(self.x, self.w, 1e-6), self.dy)

    def _hf_fwd_bwd(self, fn, dy, *inputs):
        # the reference runs forward + backward too, so the reported speedup compares like with like
        inputs = [t.detach().requires_grad_() for t in inputs]
        y = fn(*inputs, 1e-6)
        y.backward(dy)
        return y.detach()

    def verify_rms_norm(self):
        return self._hf_fwd_bwd(self.kernel.rms_norm_hf, self.dy, self.x, self.w)

    def benchmark_rms_norm_zero_centered(self):
        self._fwd_bwd(self.kernel.rms_norm_zero_centered(self.x, self.wz, 1e-6), self.dy)

    def verify_rms_norm_zero_centered(self):
        return self._hf_fwd_bwd(self.kernel.rms_norm_zero_centered_hf, self.dy, self.x, self.wz)

    def benchmark_rms_norm_gated(self):
        self._fwd_bwd(self.kernel.rms_norm_gated(self.xg, self.g, self.wg, 1e-6), self.dyg)

    def verify_rms_norm_gated(self):
        return self._hf_fwd_bwd(self.kernel.rms_norm_gated_hf, self.dyg, self.xg, self.g, self.wg)
