"""`kernels benchmark` workloads for hubfuse/cross-entropy (forward; bf16 on GPU, fp32 small on CPU).

`verify_*` returns the materialised fp32 reference loss (the CLI compares with allclose(atol=1e-2)).
"""
import torch
import torch.nn.functional as F

from kernels.benchmark import Benchmark


class LinearCrossEntropyBenchmark(Benchmark):
    seed = 0

    def _make(self, gpu_shape, cpu_shape):
        N, H, V = gpu_shape if self.device != "cpu" else cpu_shape
        dt = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.h = torch.randn(N, H, device=self.device, dtype=dt)
        self.w = torch.randn(V, H, device=self.device, dtype=dt) * 0.02
        self.y = torch.randint(0, V, (N,), device=self.device)
        self.y[::16] = -100

    def setup_qwen_vocab(self):
        self._make((16384, 4096, 151936), (64, 32, 1001))

    def benchmark_qwen_vocab(self):
        self.out = self.kernel.linear_cross_entropy(self.h, self.w, self.y)

    def verify_qwen_vocab(self):
        return F.cross_entropy((self.h @ self.w.t()).float(), self.y)

    def setup_qwen_vocab_all_options(self):
        self._make((8192, 4096, 151936), (64, 32, 1001))

    def benchmark_qwen_vocab_all_options(self):
        self.out = self.kernel.linear_cross_entropy(self.h, self.w, self.y, label_smoothing=0.1,
                                                    z_loss_weight=1e-4, softcap=30.0)

    def verify_qwen_vocab_all_options(self):
        return self.kernel.linear_cross_entropy_reference(self.h, self.w, self.y, label_smoothing=0.1,
                                                          z_loss_weight=1e-4, softcap=30.0)[0]


class CrossEntropyBenchmark(Benchmark):
    seed = 0

    def setup_logits(self):
        N, V = (16384, 151936) if self.device != "cpu" else (64, 1001)
        dt = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.x = torch.randn(N, V, device=self.device, dtype=dt)
        self.y = torch.randint(0, V, (N,), device=self.device)

    def benchmark_logits(self):
        self.out = self.kernel.cross_entropy(self.x, self.y)

    def verify_logits(self):
        return F.cross_entropy(self.x.float(), self.y)
