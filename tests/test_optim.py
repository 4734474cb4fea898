"""hubfuse.optim.AdamW against a float64 AdamW and against torch's AdamW.

- The kernel path (large tensors; `KERNEL_MIN_NUMEL` lowered so that small test tensors take it: the Triton
  kernel under the interpreter on CPU, on the GPU for real) and torch's path (the rest) in one optimizer, several
  steps, odd sizes, fp32 / bf16 / fp16, weight decay on and off, maximize, a float and a tensor learning rate;
  states start random (never zeros).
- Plain CPU (no interpreter): bit for bit torch.optim.AdamW.
- state_dict: ours -> torch's AdamW and back, the same trajectory.
- Bad input: torch-only options and sparse gradients raise; what the kernel does not take (mixed dtypes,
  non-contiguous tensors, DTensors) goes through torch's path.
- Small tensors: eagerly torch's path; the many-tensor launch (one launch a group and dtype over a table of
  addresses) against float64 and bit for bit against a launch a tensor, where the table is rebuilt and reused.
- GPU: no host sync, one CUDA graph replays the eager step bit for bit (the small tensors through the many-tensor
  launch in the graph; through torch's kernel in a graph captured before any eager step), and the error against
  float64 is at most torch's fused AdamW's.
"""
import copy
import math

import pytest
import torch

from hubfuse.optim import AdamW



# rounding of the stored result, in units of the dtype's eps, on top of 4 fp32 eps of the fp32 math; the
# interpreter truncates fp32 -> bf16 (test_interpreter_bf16) where the GPU rounds to nearest
STORE_EPS = {torch.float32: 0.0, torch.bfloat16: 0.5, torch.float16: 0.5}


def _eps(dtype):
    return torch.finfo(dtype).eps


def _tolerance(dtype):
    return STORE_EPS[dtype] * _eps(dtype) + 4 * _eps(torch.float32)


def _reference_step(p, g, m, v, t, lr, beta1, beta2, eps, wd, maximize):
    """One AdamW step in float64 from the given (rounded) tensors: ((p, m, v), (their scales)), a scale being the
    sum of the absolute terms of the element's sum (what a rounding error is relative to)."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    g = -g if maximize else g
    decayed = p - lr * wd * p
    m_new = beta1 * m + (1 - beta1) * g
    v_new = beta2 * v + (1 - beta2) * g * g
    update = lr / (1 - beta1 ** t) * m_new / (v_new.sqrt() / math.sqrt(1 - beta2 ** t) + eps)
    scales = (p.abs() + (lr * wd * p).abs() + update.abs(), (beta1 * m).abs() + ((1 - beta1) * g).abs(), v_new)
    return (decayed - update, m_new, v_new), scales


def _params(shapes, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).to(device, dtype)) for s in shapes]
    return ps, gen


def _random_state(opt, gen, step):
    """Every parameter's state with random moments (v > 0) and the given step count, as a loaded state_dict
    would set it (the step count on the CPU)."""
    for p in opt.param_groups[0]["params"]:
        opt.state[p] = {"step": torch.tensor(float(step)),
                        "exp_avg": (torch.randn(p.shape, generator=gen) * 1e-2).to(p.device, p.dtype),
                        "exp_avg_sq": (torch.rand(p.shape, generator=gen) * 1e-4 + 1e-6).to(p.device, p.dtype)}


def _check_against_float64(dtype, device, lr_kind, weight_decay, maximize, steps_before, kernel_min, seed=0):
    shapes = [(37, 53), (7,), (300, 41), (1, 1), (129, 3)]
    ps, gen = _params(shapes, dtype, device, seed)
    lr = 3e-3 if lr_kind == "float" else torch.tensor(3e-3, device=device)
    opt = AdamW(ps, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, maximize=maximize)
    opt.KERNEL_MIN_NUMEL = kernel_min
    opt.MANY_TENSOR_LAUNCH = "always"
    _random_state(opt, gen, steps_before)
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device, dtype)
    before = {p: (p.detach().clone(), p.grad.clone(), opt.state[p]["exp_avg"].clone(),
                  opt.state[p]["exp_avg_sq"].clone()) for p in ps}
    opt.step()
    for p in ps:
        state = opt.state[p]
        assert state["step"].item() == steps_before + 1
        ref, scales = _reference_step(*before[p], steps_before + 1, 3e-3, 0.9, 0.99, 1e-8, weight_decay, maximize)
        for name, got, want, scale in zip(("param", "exp_avg", "exp_avg_sq"),
                                          (p, state["exp_avg"], state["exp_avg_sq"]), ref, scales):
            # a subnormal result (fp16 states) is rounded to the dtype's smallest step, not relative to itself
            subnormal_step = STORE_EPS[dtype] * _eps(dtype) * torch.finfo(dtype).smallest_normal
            err = ((got.double() - want).abs() - subnormal_step).clamp_min(0) / scale.clamp_min(1e-30)
            assert err.max().item() <= _tolerance(dtype), (name, tuple(p.shape), err.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_decay,maximize,lr_kind", [(0.01, False, "float"), (0.0, True, "tensor"),
                                                           (0.1, False, "tensor")])
@pytest.mark.parametrize("steps_before", [0, 6, 2000])
@pytest.mark.parametrize("launch", ["per_tensor", "many"])
def test_step_matches_float64(use_kernel_path, dtype, weight_decay, maximize, lr_kind, steps_before, launch):
    """Every tensor through the kernels: a launch each (KERNEL_MIN_NUMEL=1) or all in one (the many-tensor
    launch, KERNEL_MIN_NUMEL above every size)."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): test_interpreter_bf16")
    _check_against_float64(dtype, device, lr_kind, weight_decay, maximize, steps_before,
                           1 if launch == "per_tensor" else 1 << 40)


def test_beta1_zero_and_complex(use_kernel_path):
    """beta1 = 0 (RMSprop-like, ln(beta1) = -inf in the kernel) against float64; a complex parameter takes
    torch's path and matches torch's AdamW."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps, gen = _params([(33, 17)], torch.float32, device, 8)
    opt = AdamW(ps, lr=3e-3, betas=(0.0, 0.99), weight_decay=0.01)
    opt.KERNEL_MIN_NUMEL = 1
    _random_state(opt, gen, 4)
    p = ps[0]
    p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
    before = (p.detach().clone(), p.grad.clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
    opt.step()
    (want, _, _), (scale, _, _) = _reference_step(*before, 5, 3e-3, 0.0, 0.99, 1e-8, 0.01, False)
    assert ((p.double() - want).abs() / scale).max().item() <= _tolerance(torch.float32)
    z = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.complex64, device=device))
    w = torch.nn.Parameter(z.detach().clone())
    # on CUDA the step counts live on the device, so the rest takes torch's capturable form: compare with it
    ours, theirs = AdamW([z], lr=1e-2), torch.optim.AdamW([w], lr=1e-2, capturable=device == "cuda")
    ours.KERNEL_MIN_NUMEL = 1
    for _ in range(2):
        z.grad = torch.randn_like(z)
        w.grad = z.grad.clone()
        ours.step()
        theirs.step()
    torch.testing.assert_close(z, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_small_tensors_are_torch_adamw_bit_for_bit(use_kernel_path, dtype):
    """Eagerly, below KERNEL_MIN_NUMEL the step is torch's AdamW's (its fused kernel on CUDA, its default on
    CPU): the many-tensor launch runs in captured graphs only (MANY_TENSOR_LAUNCH = "graph")."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps, gen = _params([(37, 53), (7,)], dtype, device, 4)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = AdamW(ps, lr=3e-3, weight_decay=0.02)
    theirs = torch.optim.AdamW(qs, lr=3e-3, weight_decay=0.02, fused=True if device == "cuda" else None)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device, dtype)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ps, qs):  # fp16 on CPU: torch computes in fp16 and eps=1e-8 underflows (NaN where v is 0)
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"], rtol=0, atol=0)


def test_interpreter_bf16(use_kernel_path):
    """Under the interpreter the kernel's bf16 stores truncate: within one bf16 eps there, not half of one."""
    use_kernel_path("triton")
    if torch.cuda.is_available():
        pytest.skip("the GPU rounds to nearest: test_step_matches_float64")
    STORE_EPS[torch.bfloat16] = 1.0
    try:
        _check_against_float64(torch.bfloat16, "cpu", "float", 0.01, False, 6, 1)
        _check_against_float64(torch.bfloat16, "cpu", "float", 0.01, False, 6, 1 << 40)
    finally:
        STORE_EPS[torch.bfloat16] = 0.5


def test_kernel_path_is_taken(use_kernel_path, monkeypatch):
    """Tensors at or above KERNEL_MIN_NUMEL get a launch each, the smaller ones one launch a param group and dtype,
    what the kernels do not take (non-contiguous, complex) torch's adam in one call."""
    use_kernel_path("triton")
    from hubfuse import _optim_kernels as triton_kernels
    from hubfuse import optim as adamw_module

    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = {"kernel": [], "many": [], "torch": []}
    real_update, real_many, real_adam = (triton_kernels.adamw_update, triton_kernels.adamw_update_many,
                                         adamw_module._torch_adam)
    monkeypatch.setattr(triton_kernels, "adamw_update", lambda p, *a: (calls["kernel"].append(p.numel()),
                                                                        real_update(p, *a)))
    monkeypatch.setattr(triton_kernels, "adamw_update_many", lambda info, dtype, *a: (
        calls["many"].append((info[1], dtype)), real_many(info, dtype, *a)))
    monkeypatch.setattr(adamw_module, "_torch_adam", lambda params, *a, **k: (calls["torch"].append(len(params)),
                                                                              real_adam(params, *a, **k)))
    ps, _ = _params([(64, 33), (5,), (100,), (7, 3)], torch.float32, device, 1)
    ps += _params([(9,), (4, 4)], torch.float16, device, 2)[0]
    ps.append(torch.nn.Parameter(torch.randn(6, 4, device=device).t()))  # not contiguous
    ps.append(torch.nn.Parameter(torch.randn(5, dtype=torch.complex64, device=device)))
    opt = AdamW(ps)
    opt.KERNEL_MIN_NUMEL = 100
    opt.MANY_TENSOR_LAUNCH = "always"
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert sorted(calls["kernel"]) == [100, 64 * 33] and calls["torch"] == [2]
    assert sorted(calls["many"], key=str) == [(2, torch.float16), (2, torch.float32)]
    assert all(opt.state[p]["step"].item() == 1 for p in ps)


def test_many_tensor_launch_equals_a_launch_each(use_kernel_path):
    """The many-tensor launch does each element's arithmetic as the one-tensor kernel: bit for bit, over steps
    where the gradients move (the address table rebuilt) and where they stay (the table reused), in two param
    groups."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(37, 53), (7,), (300, 41), (1, 1), (129, 3)]
    runs = []
    for kernel_min in (1, 1 << 40):
        ps, gen = _params(shapes, torch.float32, device, 11)
        opt = AdamW([{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}], lr=2e-3, weight_decay=0.05)
        opt.KERNEL_MIN_NUMEL = kernel_min
        opt.MANY_TENSOR_LAUNCH = "always"
        runs.append((ps, opt))
    tables = []
    for step in range(4):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for ps, opt in runs:
            for p, g in zip(ps, grads):
                if step == 2:  # same tensors as the step before: the table is reused
                    p.grad.copy_(g)
                else:
                    p.grad = g.clone()
            opt.step()
        tables.append([entry[1] for entry in runs[1][1]._address_tables.latest.values()])
    for p, q in zip(runs[0][0], runs[1][0]):
        assert torch.equal(p, q)
        assert torch.equal(runs[0][1].state[p]["exp_avg_sq"], runs[1][1].state[q]["exp_avg_sq"])
    assert len(tables[2]) == 2 and all(a is b for a, b in zip(tables[1], tables[2]))


def test_cpu_is_torch_adamw_bit_for_bit(use_kernel_path):
    use_kernel_path("torch")
    ps, gen = _params([(31, 17), (9,)], torch.float32, "cpu", 2)
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = AdamW(ps, lr=1e-2, weight_decay=0.05)
    theirs = torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.05)
    for _ in range(4):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q) and torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"])


def test_state_dict_round_trip_with_torch(use_kernel_path):
    """Our state_dict loads into torch.optim.AdamW and back; the trajectories stay together."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ps, gen = _params([(40, 30), (11,)], torch.float32, device, 3)
    ours = AdamW(ps, lr=1e-2)
    ours.KERNEL_MIN_NUMEL = 100
    grads = [[torch.randn(p.shape, generator=gen).to(device) for p in ps] for _ in range(3)]
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    ours.step()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    theirs = torch.optim.AdamW(qs, lr=1e-2)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # as torch.save / torch.load would
    for p, q, g in zip(ps, qs, grads[1]):
        p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    theirs.step()
    back = AdamW([torch.nn.Parameter(q.detach().clone()) for q in qs], lr=1e-2)
    back.KERNEL_MIN_NUMEL = 100
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for p, r, g in zip(ps, back.param_groups[0]["params"], grads[2]):
        p.grad, r.grad = g.clone(), g.clone()
    ours.step()
    back.step()
    for p, r in zip(ps, back.param_groups[0]["params"]):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)  # ulps of the fp32 math apart; a lost state: 1e-3
        assert back.state[r]["step"].item() == 3


def test_compiled_step_fullgraph(use_kernel_path):
    """torch.compile(opt.step, fullgraph=True): the kernel is one opaque custom op (no graph break); the kernel's
    tensors bit for bit as eager, the rest as torch's compiled AdamW (fp32 roundings)."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    runs = []
    for _ in range(2):
        ps, gen = _params([(64, 33), (5,)], torch.float32, device, 9)
        opt = AdamW(ps, lr=1e-2, weight_decay=0.1)
        opt.KERNEL_MIN_NUMEL = 100
        runs.append((ps, opt))
    (eager_ps, eager_opt), (compiled_ps, compiled_opt) = runs
    torch._dynamo.reset()
    compiled_step = torch.compile(compiled_opt.step, fullgraph=True)
    for _ in range(3):
        for p, q in zip(eager_ps, compiled_ps):
            p.grad = torch.randn(p.shape, generator=gen).to(device)
            q.grad = p.grad.clone()
        eager_opt.step()
        compiled_step()
    assert torch.equal(eager_ps[0], compiled_ps[0])
    torch.testing.assert_close(eager_ps[1], compiled_ps[1], rtol=1e-6, atol=1e-6)
    assert compiled_opt.state[compiled_ps[0]]["step"].item() == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(amsgrad=True), "amsgrad"), (dict(fused=True), "fused"), (dict(foreach=True), "foreach"),
    (dict(differentiable=True), "differentiable"), (dict(betas=(torch.tensor(0.9), 0.999)), "betas"),
    (dict(betas=(0.9,)), "betas"), (dict(lr=-1.0), "learning rate"), (dict(eps=-1.0), "epsilon"),
    (dict(betas=(1.0, 0.999)), "beta"), (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_sparse_gradient_is_a_clear_error(use_kernel_path):
    use_kernel_path("triton")
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        AdamW([p]).step()


@pytest.mark.parametrize("case", ["grad_dtype", "noncontiguous", "nan"])
def test_what_the_kernel_does_not_take_is_torch_s(use_kernel_path, case):
    """A gradient of another dtype or a non-contiguous parameter goes through torch's path (as torch's AdamW
    does with it); NaN in a gradient gives NaN where torch's does, and nowhere else."""
    use_kernel_path("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = torch.randn(30, 40, device=device)
    p = torch.nn.Parameter(base.t() if case == "noncontiguous" else base.clone())
    q = torch.nn.Parameter(p.detach().clone())
    assert q.stride() == p.stride()
    grad = torch.randn_like(p)  # the parameter's strides, as autograd makes its gradient
    if case == "nan":
        grad[3, 5] = float("nan")
    ours = AdamW([p], lr=1e-2)
    ours.KERNEL_MIN_NUMEL = 1
    theirs = torch.optim.AdamW([q], lr=1e-2, fused=device == "cuda")
    if case == "grad_dtype":  # fp64 gradients of fp32 parameters (grad_dtype opened)
        p.grad_dtype = q.grad_dtype = None
        p.grad, q.grad = grad.double(), grad.double()
        try:
            theirs.step()
        except RuntimeError as theirs_error:
            with pytest.raises(type(theirs_error)):
                ours.step()
            return
    else:
        p.grad, q.grad = grad.clone(), grad.clone()
    ours.step()
    theirs.step()
    assert torch.equal(p.isnan(), q.isnan()) and p.isnan().sum() == (case == "nan")
    torch.testing.assert_close(p, q, rtol=4 * _eps(torch.float32), atol=1e-7, equal_nan=True)


# ------------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_error_at_most_torch_fused():
    """bf16 weights and states, 3 steps from random states: our relative L2 error against float64 is at most
    torch's fused AdamW's (same inputs, same rounding points)."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(4099, 1031), (7, 513)]
    ps = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.5).cuda().bfloat16()) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = AdamW(ps, lr=1e-3, weight_decay=0.01)
    ours.KERNEL_MIN_NUMEL = 1
    theirs = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.01, fused=True)
    errors = {"ours": [], "torch": []}
    for p, q in zip(ps, qs):
        p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    ours.step()
    theirs.step()
    for opt, params in ((ours, ps), (theirs, qs)):
        g2 = torch.Generator().manual_seed(6)
        for p in params:
            opt.state[p]["exp_avg"].copy_(torch.randn(p.shape, generator=g2) * 1e-2)
            opt.state[p]["exp_avg_sq"].copy_(torch.rand(p.shape, generator=g2) * 1e-4 + 1e-6)
    for step in range(3):
        g3 = torch.Generator().manual_seed(10 + step)
        grads = [(torch.randn(p.shape, generator=g3) * 1e-2).cuda().bfloat16() for p in ps]
        for name, opt, params in (("ours", ours, ps), ("torch", theirs, qs)):
            before = [(p.detach().clone(), g, opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                      for p, g in zip(params, grads)]
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            for p, b in zip(params, before):
                want, _ = _reference_step(*b, opt.state[p]["step"].item(), 1e-3, 0.9, 0.999, 1e-8, 0.01, False)
                for got, w in zip((p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]), want):
                    errors[name].append(((got.double() - w).norm() / w.norm()).item())
    for ours_err, torch_err in zip(errors["ours"], errors["torch"]):
        assert ours_err <= torch_err * 1.001 + 1e-12, (errors["ours"], errors["torch"])


def _replays_and_eager_steps(graph, static_grads, batches, twin, twin_params):
    """For each batch of gradients: copied into the graph's static gradients and replayed; the same gradients
    given to the eager twin, which steps."""
    for batch in batches:
        for s, g in zip(static_grads, batch):
            s.copy_(g)
        graph.replay()
        for q, g in zip(twin_params, batch):
            q.grad = g.clone()
        twin.step()


@pytest.mark.gpu
def test_gpu_step_syncs_nothing_and_replays_in_a_graph():
    gen = torch.Generator().manual_seed(7)
    shapes = [(1000, 37), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda().bfloat16()) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    lr = torch.tensor(1e-3, device="cuda")
    ours, twin = AdamW(ps, lr=lr), AdamW(qs, lr=lr.clone())
    ours.KERNEL_MIN_NUMEL = twin.KERNEL_MIN_NUMEL = 1000
    twin.MANY_TENSOR_LAUNCH = "never"  # the first step eager in both: torch's kernel for the small tensor
    grads = [[torch.randn(s, generator=gen).cuda().bfloat16() for s in shapes] for _ in range(5)]
    static = [torch.empty_like(g) for g in grads[0]]
    for opt, params in ((ours, ps), (twin, qs)):  # states, kernels compiled
        for p, g in zip(params, grads[0]):
            p.grad = g.clone()
        opt.step()
    torch.cuda.synchronize()
    twin.MANY_TENSOR_LAUNCH = "always"  # then what the graph replays: the many-tensor launch for it
    for p, s in zip(ps, static):
        p.grad = s
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            ours.step()
        _replays_and_eager_steps(graph, static, grads[1:], twin, qs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q) and torch.equal(ours.state[p]["exp_avg"], twin.state[q]["exp_avg"])
    assert ours.state[ps[0]]["step"].item() == 5
    assert len(ours._address_tables.captured) == 1  # the small tensor: the many-tensor launch in the graph


@pytest.mark.gpu
def test_gpu_graph_captured_before_any_eager_step():
    """A step captured first (no eager step has made the many-tensor launch's host buffer): the small tensors go
    through torch's capturable kernel, and replays equal eager steps that take that path too."""
    gen = torch.Generator().manual_seed(8)
    shapes = [(1000, 37), (5, 7), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda().bfloat16()) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours, twin = AdamW(ps, lr=1e-3), AdamW(qs, lr=1e-3)
    ours.KERNEL_MIN_NUMEL = twin.KERNEL_MIN_NUMEL = 1000
    twin.MANY_TENSOR_LAUNCH = "never"
    for opt in (ours, twin):  # states made before the capture (a captured zeros_like would run at every replay)
        _random_state(opt, gen, 3)
        for p in opt.param_groups[0]["params"]:
            opt.state[p]["step"] = opt.state[p]["step"].cuda()
    for p, q in zip(ps, qs):
        for key in ("exp_avg", "exp_avg_sq"):
            twin.state[q][key] = ours.state[p][key].clone()
    grads = [[torch.randn(s, generator=gen).cuda().bfloat16() for s in shapes] for _ in range(4)]
    static = [g.clone() for g in grads[0]]
    for p, s in zip(ps, static):
        p.grad = s
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        ours.step()
    torch.cuda.current_stream().wait_stream(side)
    _replays_and_eager_steps(graph, static, grads, twin, qs)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q) and torch.equal(ours.state[p]["exp_avg_sq"], twin.state[q]["exp_avg_sq"])


def test_unknown_many_tensor_mode_is_a_clear_error(use_kernel_path):
    use_kernel_path("triton")
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    opt = AdamW([p])
    opt.MANY_TENSOR_LAUNCH = True
    with pytest.raises(ValueError, match="MANY_TENSOR_LAUNCH"):
        opt.step()


@pytest.mark.gpu
def test_gpu_two_graphs_each_take_the_many_tensor_launch():
    """Two graphs captured in turn (one per batch shape, as `capture_train_step` is used with buckets), each after
    an eager step: both send the small tensors through the many-tensor launch, each copying its table from a host
    buffer of its own (the eager step renews the one the first capture took)."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(1000, 37), (5, 7), (3,)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda().bfloat16()) for s in shapes]
    opt = AdamW(ps, lr=1e-3)
    opt.KERNEL_MIN_NUMEL = 1000
    side = torch.cuda.Stream()
    graphs = []
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).cuda().bfloat16()
        opt.step()  # eager: reserves the host buffer a capture copies its table from
        for p in ps:  # the graph's gradients, at addresses of their own
            p.grad = torch.randn(p.shape, generator=gen).cuda().bfloat16()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graphs.append(graph)
    assert len(opt._address_tables.captured) == 2
    for graph in graphs:
        graph.replay()
    assert all(torch.isfinite(p).all() for p in ps)
