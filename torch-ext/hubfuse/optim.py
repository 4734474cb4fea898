"""hubfuse's optimizers. `AdamW`: torch's AdamW (same arguments, state and state_dict) whose step on a GPU updates every
tensor in Triton passes at copy bandwidth.

torch's fused AdamW (`fused=True`, what HF's Trainer picks by default) runs its multi-tensor kernel in launches of
at most 320 blocks of 64K elements: on an H100 / H200 (132 SMs) that is one partial wave a launch, ~2.7 TB/s on
bf16 weights and states. Here each tensor of `KERNEL_MIN_NUMEL` elements and up gets a launch over the whole
tensor; the smaller ones (norms, small projections: many tensors, a fraction of the bytes) share one launch a
param group and dtype, whose programs find their tensor in a table of addresses on the device (rebuilt only
when the tensors move). That table costs host time a tensor, so eager steps send the small tensors through
torch's fused kernel (one call) and captured CUDA graphs, which pay it once, through the shared launch
(`MANY_TENSOR_LAUNCH`). What the kernels do not take (complex or non-contiguous tensors, mixed dtypes) goes
through torch's own AdamW: its fused kernel, or its multi-tensor one where a tensor is complex.

Numerics: the same update as torch's (decoupled weight decay, bias corrections from the step count, fp32 math,
each tensor stored in its own dtype); on CPU (without `TRITON_INTERPRET=1`) the step is torch's own. The step
count and a tensor learning rate stay on the device: the step is capturable in a CUDA graph
(`hubfuse.cuda_graphs.capture_train_step`) whatever `capturable` says (a graph captured before any eager step
sends the small tensors through torch's capturable kernel: the table's pinned host buffer is reserved by an eager
step).
Sharded parameters (FSDP2, expert parallelism: DTensors) are updated on their local shards, no communication
(AdamW is element-wise). Under torch.compile the small tensors take torch's path (traced and compiled).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.optim.adam import adam as _torch_adam

from ._common.custom_op import custom_op
from ._common.device import capturing, use_triton

__all__ = ["AdamW"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@custom_op("adamw_update", mutates_args=("param", "exp_avg", "exp_avg_sq"))
def _adamw_update_op(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: torch.Tensor, lr: float, lr_tensor: Optional[torch.Tensor], beta1: float, beta2: float,
                 eps: float, weight_decay: float, maximize: bool) -> None:
    """The kernel's update of one tensor, in place, as one opaque node for torch.compile (eager steps call
    `_adamw_update_op.eager_impl`); `lr_tensor`, where given, is the learning rate on the device."""
    from ._optim_kernels import adamw_update as update

    update(param, grad, exp_avg, exp_avg_sq, step, lr if lr_tensor is None else lr_tensor, beta1, beta2, eps,
           weight_decay, maximize)


@_adamw_update_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, step, lr, lr_tensor, beta1, beta2, eps, weight_decay, maximize):
    return None


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return None
    return DTensor


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with hubfuse's one-pass kernel for large tensors on the GPU.

    Arguments as torch's: `lr` (float or 0-dim tensor), `betas` (floats), `eps`, `weight_decay`, `maximize`,
    `capturable` (kept in the param groups for torch's AdamW to load the state_dict; every CUDA step of this class
    is capturable whatever it says). `amsgrad`, `foreach`, `fused` and `differentiable` are torch-only options
    and raise a ValueError when set.
    """

    KERNEL_MIN_NUMEL = 1 << 23  # ~8M elements: ~30 us of the kernel at copy bandwidth, well above a launch
    # the smaller tensors the kernel takes, in one launch a (param group, device, dtype) over a table of their
    # addresses: "graph" while a CUDA graph is captured (eagerly torch's fused kernel, whose host cost is lower
    # than building the table's ~10 us a tensor), "always", or "never"
    MANY_TENSOR_LAUNCH = "graph"
    capturable_on_cuda = True  # hubfuse.cuda_graphs.capture_train_step takes it without capturable=True

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None):
        for name, value, default in (("amsgrad", amsgrad, False), ("foreach", foreach, None),
                                     ("differentiable", differentiable, False), ("fused", fused, None)):
            if value != default:
                raise ValueError(f"hubfuse.optim.AdamW: {name}={value!r} is not supported (it chooses its own "
                                 f"kernels and has no {name} mode); use torch.optim.AdamW for it")
        if not all(isinstance(b, float) for b in betas) or len(betas) != 2:
            raise ValueError(f"hubfuse.optim.AdamW: betas must be two floats, got {betas!r}")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                         capturable=capturable)

    def _new_state(self, p: torch.Tensor) -> dict:
        """The parameter's state, created as torch's fused AdamW does (an fp32 step count on the device where the
        update runs there)."""
        step_device = p.device if (p.device.type != "cpu" or use_triton(p)) else "cpu"
        state = self.state[p]
        state.update(step=torch.zeros((), dtype=torch.float32, device=step_device),
                     exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                     exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        return state

    @staticmethod
    def _kernel_tensors(p: torch.Tensor, state: dict, lr) -> tuple | None:
        """(param, grad, exp_avg, exp_avg_sq) as the kernel takes them, or None where it does not: plain tensors
        of one dtype, contiguous, where Triton runs. DTensors (FSDP2 shards, expert-parallel banks) whose gradient
        and states are laid out as the parameter give their local shards (the update is element-wise)."""
        tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
        if type(p.data) is not torch.Tensor:
            dtensor = _dtensor_class()
            if dtensor is None or not all(isinstance(t, dtensor) and t.placements == p.placements
                                          and t.device_mesh == p.device_mesh for t in tensors):
                return None
            tensors = tuple(t.to_local() for t in tensors)
        local = tensors[0]
        if not (local.dtype in _KERNEL_DTYPES and all(t.dtype == local.dtype and t.is_contiguous()
                                                      and t.device == local.device for t in tensors)
                and use_triton(local) and (isinstance(lr, float) or lr.device == local.device)):
            return None
        return tensors

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _many_tensor_tables(self, index: int, small: dict, rest: dict) -> list:
        """[(table info, dtype, entries)] for the many-tensor launches of param group `index` (`small`: (device,
        dtype) -> [(param, tensors, state)]); a slot without a table (a capture with no reserved host buffer) is
        moved to `rest`, torch's path."""
        from ._optim_kernels import AddressTables, many_table

        tables = self.__dict__.setdefault("_address_tables", AddressTables())
        launches = []
        for (device, dtype), entries in small.items():
            info = many_table(tables, (index, device, dtype), [(t, state["step"]) for _, t, state in entries])
            if info is None:
                rest.setdefault(device.type == "cuda", []).extend((p, state) for p, _, state in entries)
            else:
                launches.append((info, dtype, entries))
        return launches

    def _step_group(self, index: int, group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        lr = float(lr) if isinstance(lr, (int, float)) else lr
        rest: dict[bool, list] = {}
        kernel = []
        small: dict[tuple, list] = {}  # (device, dtype) -> [(param, tensors, state)] for the many-tensor launch
        min_numel = self.KERNEL_MIN_NUMEL
        mode = self.MANY_TENSOR_LAUNCH
        if mode not in ("graph", "always", "never"):
            raise ValueError(f"hubfuse.optim.AdamW.MANY_TENSOR_LAUNCH: expected 'graph', 'always' or 'never', got "
                             f"{mode!r}")
        compiling = torch.compiler.is_compiling()
        params = group["params"]
        cuda_group = len(params) > 0 and params[0].is_cuda  # (dynamo on torch 2.11 cannot trace bool(list))
        many = not compiling and (mode == "always" or mode == "graph" and cuda_group and capturing(params[0].device))
        if mode == "graph" and not many and not compiling and cuda_group:
            from ._optim_kernels import AddressTables

            self.__dict__.setdefault("_address_tables", AddressTables()).reserve(index, len(params))
        for p in params:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("hubfuse.optim.AdamW does not support sparse gradients")
            state = self.state[p] or self._new_state(p)
            if p.is_cuda and state["step"].device != p.device:  # a loaded state_dict keeps it on the CPU
                state["step"] = state["step"].to(p.device, torch.float32)
            tensors = self._kernel_tensors(p, state, lr) if many or p.numel() >= min_numel else None
            numel = 0 if tensors is None else tensors[0].numel()
            if numel >= min_numel:
                kernel.append((tensors, state))
            elif many and numel > 0 and state["step"].dtype == torch.float32:
                small.setdefault((tensors[0].device, tensors[0].dtype), []).append((p, tensors, state))
            else:
                rest.setdefault(p.is_cuda, []).append((p, state))
        launches = self._many_tensor_tables(index, small, rest) if small else []
        if kernel or launches:
            lr_float, lr_tensor = (lr, None) if isinstance(lr, float) else (0.0, lr)
            torch._foreach_add_([state["step"] for _, state in kernel]
                                + [state["step"] for _, _, entries in launches for _, _, state in entries], 1)
            update = _adamw_update_op if compiling else _adamw_update_op.eager_impl
            for tensors, state in kernel:
                update(*tensors, state["step"], lr_float, lr_tensor, beta1, beta2, group["eps"],
                       group["weight_decay"], group["maximize"])
            if launches:
                from ._optim_kernels import adamw_update_many

                for info, dtype, _ in launches:
                    adamw_update_many(info, dtype, lr, beta1, beta2, group["eps"], group["weight_decay"],
                                      group["maximize"])
        for cuda, entries in rest.items():
            rest_params = [p for p, _ in entries]
            has_complex = any(torch.is_complex(p) for p in rest_params)
            # torch's own AdamW math on the rest: its fused kernel on CUDA (one call for all; its default where a
            # tensor is complex, which the fused kernel does not take, and under torch.compile, which does not
            # trace the fused kernel: its multi-tensor form, compiled), its default on CPU. The step counts of
            # CUDA parameters live on the device, so torch's capturable form there (no host read of the step)
            fused = cuda and not has_complex and not compiling
            _torch_adam(
                rest_params, [p.grad for p in rest_params], [s["exp_avg"] for _, s in entries],
                [s["exp_avg_sq"] for _, s in entries], [], [s["step"] for _, s in entries],
                fused=True if fused else None, capturable=cuda,
                has_complex=has_complex, decoupled_weight_decay=True,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"])
