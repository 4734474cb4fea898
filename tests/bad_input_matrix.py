"""The bad-input matrix: every public op, Layer and Layout of the kernel repos against float64 torch.

One generator for every op family. A *problem* describes the inputs of an op family (argument shapes per shape
case, roles) and its float64 torch oracle; a *target* is one public callable on it (the functional op, the
Layer bound to its Layout, the Layout itself). A *cell* is one target on one CPU path (`ref`: the torch path,
`interp`: the Triton kernels under the interpreter, `cuda`) in one mode (eager / torch.compile) with one value
on each axis:

    dtype    fp16, bf16, fp32, fp64, int (the main input an integer tensor), mixed (fp32 inputs, fp16 params)
    device   every argument in turn on another device (`meta` stands in for it)
    shape    empty, one row, odd sizes, a size above the kernels' block limits, batch dims of rank 1-4
    layout   every argument in turn strided (::2 on the last dim), transposed (column-major), expanded (stride 0
             on the first dim), broadcast (stride 0 on the last dim), sliced (a view with row padding and offset)
    values   NaN, inf in the main input; ids below 0 / at or above the bound (and the MoE skip sentinel)
    grad     every float argument requires grad / none / only the inputs (weights frozen) / only the weights

A cell's outcome: `correct` (forward and every gradient match the float64 oracle; NaN/inf where torch has them),
`clear error` (TypeError / ValueError / RuntimeError whose message names the argument at fault), or a failure:
`silent wrong` (a result that differs from torch, a missing gradient, or a result where torch raises),
`unclear error` (an error that names no argument at fault, or of another type), `error on supported input`
(an error for an input the target declares supported). Cells are sampled: each axis value alone from a base
case (one factor at a time), a fixed-seed set of pairs of non-default values, and a few compiled cells per
target (compile is slow).

    python -m pytest tests/test_bad_input_matrix.py            # runs it, writes out/bad_input_matrix.md
    HUBFUSE_BAD_INPUT_REPORT=docs/bad_input_matrix.md python -m pytest tests/test_bad_input_matrix.py
                                                             # writes the report to docs/bad_input_matrix.md
"""
from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import time
import types
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
DTYPE_VALUES = ("fp32", "fp16", "bf16", "fp64", "int", "mixed")
SHAPE_VALUES = ("base", "empty", "one_row", "odd", "big", "batch1", "batch2", "batch3", "batch4")
LAYOUT_KINDS = ("strided", "transposed", "expanded", "broadcast", "sliced")
# default: every float argument but buffers (cos / sin: HF computes them without grad); all: buffers too
GRAD_VALUES = ("default", "all", "none", "inputs", "params")
HALF = ("fp16", "bf16", "fp32")
NO_BIG = ("base", "one_row", "odd", "batch1", "batch2", "batch3", "batch4")  # "big" is past the op's limit
# relative tolerance per dtype: the kernels compute in fp32, so fp64 inputs are held to fp32's
TOL = {"fp16": 5e-3, "bf16": 4e-2, "fp32": 2e-5, "fp64": 2e-5, "int": 2e-5, "mixed": 5e-3}
CLEAR_ERRORS = (TypeError, ValueError, RuntimeError, NotImplementedError)
# leading (batch/token) dims per shape case, for the ops on rows
LEAD = {"base": (3, 5), "empty": (0, 5), "one_row": (1,), "odd": (3, 7), "big": (2,), "batch1": (5,),
        "batch2": (2, 3), "batch3": (2, 1, 3), "batch4": (1, 2, 2, 3)}
EPS = 1e-6
IGNORE = -100


# ----------------------------------------------------------------------------------------------- specs

@dataclass(frozen=True)
class Arg:
    """One tensor argument of a problem: its shape for the cell, role and, for ids, the valid range."""
    shape: tuple
    role: str = "input"  # "input" (activation), "param" (weight), "buffer" (cos / sin), "index" (ids), "mask"
    high: int = 0  # index: valid values [0, high)
    bad_high: Optional[int] = None  # index: an out-of-range value above (default: high)
    ignore_frac: float = 0.0  # index: fraction set to IGNORE (never the first)
    scale: float = 1.0
    aliases: tuple = ()  # other names an error message may use for this argument
    values: Optional[tuple] = None  # index: fixed values (sequence offsets) instead of random ids


@dataclass
class Problem:
    """An op family's inputs (per shape case) and its float64 torch oracle."""
    name: str
    args: Callable[[str], Optional[dict]]  # shape case -> {name: Arg} (None: no such case)
    oracle: Callable  # (float64 inputs, same-dtype inputs) -> output(s)
    primary: str  # the main float input: dtype "int" and NaN / inf values apply to it
    index: Optional[str] = None  # the id argument: out-of-range values apply to it
    extra_values: tuple = ()


@dataclass
class Target:
    """A public callable on a problem. `build(args)` runs outside torch.compile and returns the function of the
    inputs (a dict by argument name) that the cell calls (and compiles)."""
    name: str
    kind: str  # "op" | "layer" | "layout"
    problem: Problem
    build: Callable[[dict], Callable[[dict], object]]
    dtypes: tuple = HALF  # supported: a result is required (else a clear error is also accepted)
    shapes: tuple = ("base", "one_row", "odd", "big", "batch1", "batch2", "batch3", "batch4")
    layouts_ok: bool = True  # every layout of every argument supported
    grads: tuple = GRAD_VALUES  # supported requires_grad combinations
    inplace: tuple = ()  # arguments the call overwrites (passed as fresh non-leaf copies)
    axes: tuple = ("dtype", "device", "shape", "layout", "values", "grad")
    layout_roles: tuple = ("input", "param", "buffer", "index", "mask")
    paths: tuple = ("ref", "interp")
    # axes run one at a time on the Triton paths (interp / cuda); None: every axis but device (checked before
    # any kernel runs). Layers: only values (they are the op plus a module; the op's own cells cover the rest).
    kernel_axes: Optional[tuple] = None
    # dtype values generated: Layouts (HF's code) and modules whose first op is a torch Linear get no integer or
    # mixed-dtype inputs (torch's own errors there, as with the HF class)
    dtype_values: Optional[tuple] = None
    interp_skip_dtypes: tuple = ()  # dtypes the Triton interpreter cannot run (GPU variant only)
    compile: bool = True
    base: tuple = ()  # (axis, value) pairs of the target's base cell, when the default base is not supported
    skip_layouts: tuple = ()  # layout values not generated (see the note)
    note: str = ""

    def __post_init__(self):
        if self.kernel_axes is None:
            self.kernel_axes = ("values",) if self.kind == "layer" else tuple(a for a in self.axes if a != "device")
        if self.dtype_values is None:
            plain = self.kind == "layout"
            self.dtype_values = tuple(v for v in DTYPE_VALUES if v != "fp32" and not (plain and v in ("int", "mixed")))


@dataclass(frozen=True)
class Cell:
    target: str
    path: str = "ref"
    mode: str = "eager"  # "eager" | "compile" (aot_eager: forward + backward graphs) | "compile_fwd" (eager)
    dtype: str = "fp32"
    device: str = "same"  # or the argument placed on another device
    shape: str = "base"
    layout: str = "contiguous"  # or "<kind>:<argument>"
    values: str = "normal"
    grad: str = "default"

    @property
    def id(self) -> str:
        parts = [self.target, self.path, self.mode]
        for axis, default in (("dtype", "fp32"), ("device", "same"), ("shape", "base"), ("layout", "contiguous"),
                              ("values", "normal"), ("grad", "default")):
            value = getattr(self, axis)
            if value != default:
                parts.append(f"{axis}={value}" if axis == "device" else value)
        return "-".join(parts)


@dataclass
class Outcome:
    cell: Cell
    category: str  # correct | clear_error | silent_wrong | unclear_error | error_on_supported
    detail: str = ""
    seconds: float = 0.0
    as_torch: bool = False  # a clear error that is torch's own (the oracle raises it, word for word)


TARGETS: dict[str, Target] = {}
# public names deliberately outside the matrix, with the reason
EXCLUDED: dict[str, str] = {}


def _target(*args, **kwargs) -> Target:
    t = Target(*args, **kwargs)
    assert t.name not in TARGETS, t.name
    TARGETS[t.name] = t
    return t


# ----------------------------------------------------------------------------------------------- helpers

def _layer(module: nn.Module, params: dict, arg_names, forward=None):
    """fn(inputs) calling `module` (its forward replaced by `forward`, as kernelize binds a Layer) on the inputs
    `arg_names`, with the cell's tensors as its parameters `params` ({parameter name: argument name}) through
    `functional_call` (any tensor: any layout, device, requires grad or not)."""
    if forward is not None:
        module.forward = types.MethodType(forward, module)
    return lambda a: torch.func.functional_call(module, {p: a[n] for p, n in params.items()},
                                                tuple(a[n] for n in arg_names))


def _silu64(x):
    return x * torch.sigmoid(x)


def _rms64(x, w, mode="standard", gate=None):
    from hubfuse.rmsnorm.reference import rms_normalize

    n = rms_normalize(x, EPS)
    y = n * (1.0 + w) if mode == "zero_centered" else w * n
    return y * _silu64(gate) if gate is not None else y


def _swiglu64(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return _silu64(g) * u


def _mlp64(x, gate_up_weight, down_weight, gate_up_bias=None, down_bias=None):
    return F.linear(_swiglu64(F.linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)


def _ce64(logits, labels, reduction="mean", label_smoothing=0.0, z_loss_weight=0.0, softcap=None):
    x = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1)
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    rows = F.cross_entropy(x, y, reduction="none", ignore_index=IGNORE, label_smoothing=label_smoothing)
    valid = y != IGNORE
    rows = rows + torch.where(valid, z_loss_weight * torch.logsumexp(x, -1) ** 2, torch.zeros_like(rows))
    if reduction == "none":
        return rows.view(labels.shape)
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum()


class Selection:
    """The oracle of a top-k id output: any k ids whose selection probabilities are the k largest (torch.topk's
    order: NaN first) are right, whatever the order among equal values."""

    def __init__(self, probs: torch.Tensor, k: int):
        self.probs, self.k = probs.detach().double(), k
        self.shape = probs.shape[:-1] + (k,)
        self.requires_grad = False

    def is_floating_point(self):
        return False


def _select(p: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest of each row: NaN first (as torch.topk), ties to the lower index (the kernels)."""
    return torch.sort(-torch.where(p.isnan(), float("inf"), p), dim=-1, stable=True).indices[..., :k]


def _top_k_rows(probs_for_selection, probs64, k, normalize):
    """(scores, Selection): the kernels' selection rule (the k largest, NaN first as in torch.topk, ties to the
    lower index) on `probs_for_selection`; the scores are the float64 probabilities of the selected experts
    (renormalised)."""
    p = probs_for_selection.double().cpu()
    order = _select(p, k)
    scores = probs64.gather(-1, order)
    if normalize:
        scores = scores / scores.sum(-1, keepdim=True)
    return scores, Selection(p, k)


def _config(**kw):
    return types.SimpleNamespace(**kw)


# ----------------------------------------------------------------------------------------------- RMSNorm

def _rms_args(gated):
    def args(shape):
        lead = LEAD[shape]
        H = {"odd": 13, "big": 65537}.get(shape, 24)  # 65536: the kernels' row limit
        out = {"hidden_states": Arg(lead + (H,), aliases=("x",))}
        if gated:
            out["gate"] = Arg(lead + (H,))
        out["weight"] = Arg((H,), "param")
        return out
    return args


def _rmsnorm_targets():
    import hubfuse.rmsnorm as rmsnorm
    from hubfuse.rmsnorm import layers as L

    variants = [("rms_norm", "standard", L.RMSNorm, L.RMSNormLayout),
                ("rms_norm_zero_centered", "zero_centered", L.RMSNormZeroCentered, L.RMSNormZeroCenteredLayout),
                ("rms_norm_gated", "gated", L.RMSNormGated, L.RMSNormGatedLayout)]
    for fn_name, mode, layer, layout in variants:
        gated = mode == "gated"
        problem = Problem(fn_name, _rms_args(gated), primary="hidden_states",
                          oracle=lambda a, lp, mode=mode, gated=gated: _rms64(
                              a["hidden_states"], a["weight"], mode, a["gate"] if gated else None))
        fn = getattr(rmsnorm, fn_name)
        names = ("hidden_states", "gate") if gated else ("hidden_states",)
        if gated:
            _target(fn_name, "op", problem, lambda s, fn=fn: lambda a: fn(a["hidden_states"], a["gate"], a["weight"]),
                    dtypes=HALF + ("fp64",), shapes=NO_BIG)
        else:
            _target(fn_name, "op", problem, lambda s, fn=fn: lambda a: fn(a["hidden_states"], a["weight"]),
                    dtypes=HALF + ("fp64", "mixed") if mode == "standard" else HALF + ("fp64",), shapes=NO_BIG)
        hidden = lambda s: s["weight"].shape[0]  # noqa: E731
        _target(f"{layer.__name__} (Layer)", "layer", problem,
                lambda s, layer=layer, layout=layout, names=names: _layer(
                    layout(hidden(s), eps=EPS), {"weight": "weight"}, names, layer.forward),
                dtypes=HALF + ("fp64",), shapes=NO_BIG)
        _target(f"{layout.__name__}", "layout", problem,
                lambda s, layout=layout, names=names: _layer(layout(hidden(s), eps=EPS), {"weight": "weight"}, names),
                dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",))


# ----------------------------------------------------------------------------------------------- SwiGLU

def _swiglu_args(shape):
    I = {"odd": 7, "big": 2051}.get(shape, 12)  # 2048: the kernels' column block
    return {"gate_up": Arg(LEAD[shape] + (2 * I,))}


def _mlp_args(norm, bias):
    def args(shape):
        lead = LEAD[shape]
        H, I = (13, 7) if shape == "odd" else (16, 2051 if shape == "big" else 12)
        out = {"hidden_states": Arg(lead + (H,), aliases=("x",))}
        if norm:
            out["norm_weight"] = Arg((H,), "param", aliases=("weight",))
        out["gate_up_weight"] = Arg((2 * I, H), "param", scale=0.3, aliases=("gate_up_proj",))
        out["down_weight"] = Arg((H, I), "param", scale=0.3, aliases=("down_proj",))
        if bias:
            out["gate_up_bias"] = Arg((2 * I,), "param", aliases=("gate_up_proj",))
            out["down_bias"] = Arg((H,), "param", aliases=("down_proj",))
        return out
    return args


def _swiglu_targets():
    import hubfuse.swiglu as swiglu
    from hubfuse.rmsnorm.layers import RMSNormLayout
    from hubfuse.swiglu import layers as L

    p = Problem("swiglu", _swiglu_args, primary="gate_up", oracle=lambda a, lp: _swiglu64(a["gate_up"]))
    _target("swiglu", "op", p, lambda s: lambda a: swiglu.swiglu(a["gate_up"]))

    mlp = Problem("swiglu_mlp", _mlp_args(norm=False, bias=True), primary="hidden_states",
                  oracle=lambda a, lp: _mlp64(a["hidden_states"], a["gate_up_weight"], a["down_weight"],
                                               a["gate_up_bias"], a["down_bias"]))
    _target("swiglu_mlp", "op", mlp, lambda s: lambda a: swiglu.swiglu_mlp(
        a["hidden_states"], a["gate_up_weight"], a["down_weight"], a["gate_up_bias"], a["down_bias"]))
    mlp_params = {"gate_up_proj.weight": "gate_up_weight", "gate_up_proj.bias": "gate_up_bias",
                  "down_proj.weight": "down_weight", "down_proj.bias": "down_bias"}

    def mlp_layout(s):
        H, I = s["hidden_states"].shape[-1], s["down_weight"].shape[1]
        return L.SwiGLUMLPLayout(_config(hidden_size=H, intermediate_size=I, mlp_bias=True, hidden_act="silu"))

    _target("SwiGLUMLP (Layer)", "layer", mlp,
            lambda s: _layer(mlp_layout(s), mlp_params, ("hidden_states",), L.SwiGLUMLP.forward))
    _target("SwiGLUMLPLayout", "layout", mlp, lambda s: _layer(mlp_layout(s), mlp_params, ("hidden_states",)),
            dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",))

    fused = Problem("rms_norm_swiglu_mlp", _mlp_args(norm=True, bias=False), primary="hidden_states",
                    oracle=lambda a, lp: _mlp64(_rms64(a["hidden_states"], a["norm_weight"]), a["gate_up_weight"],
                                                a["down_weight"]))
    _target("rms_norm_swiglu_mlp", "op", fused, lambda s: lambda a: swiglu.rms_norm_swiglu_mlp(
        a["hidden_states"], a["norm_weight"], EPS, a["gate_up_weight"], a["down_weight"]))
    fused_params = {"weight": "norm_weight", "gate_up_proj.weight": "gate_up_weight", "down_proj.weight": "down_weight"}

    def fused_layout(s):
        H, I = s["hidden_states"].shape[-1], s["down_weight"].shape[1]
        mlp_module = nn.Module()
        mlp_module.config = _config(hidden_act="silu")
        mlp_module.gate_proj, mlp_module.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        mlp_module.down_proj = nn.Linear(I, H, bias=False)
        return L.RMSNormSwiGLUMLPLayout(RMSNormLayout(H, eps=EPS), mlp_module)

    _target("RMSNormSwiGLUMLP (Layer)", "layer", fused,
            lambda s: _layer(fused_layout(s), fused_params, ("hidden_states",), L.RMSNormSwiGLUMLP.forward))
    _target("RMSNormSwiGLUMLPLayout", "layout", fused,
            lambda s: _layer(fused_layout(s), fused_params, ("hidden_states",)),
            dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",))


# ----------------------------------------------------------------------------------------------- cross-entropy

def _ce_args(shape):
    lead = (7,) if shape == "base" else LEAD[shape]  # 2-D logits (as HF's loss flattens them) unless batched
    V = {"odd": 11, "big": 16411}.get(shape, 37)  # above the GPU (4096) and interpreter (16384) blocks
    return {"logits": Arg(lead + (V,), aliases=("input",)),
            "labels": Arg(lead, "index", high=V, ignore_frac=0.25, aliases=("target",))}


def _lce_args(shape):
    lead = LEAD[shape]
    H, V = (13, 11) if shape == "odd" else ((8, 16411) if shape == "big" else (16, 37))
    return {"hidden": Arg(lead + (H,), aliases=("hidden_states",)), "weight": Arg((V, H), "param", scale=0.3),
            "labels": Arg(lead, "index", high=V, ignore_frac=0.25), "bias": Arg((V,), "param")}


def _ce_module_args(shape):
    """torch.nn.CrossEntropyLoss's shapes: input (N, C) or (N, C, d1, ...), target (N,) or (N, d1, ...)."""
    shapes = {"base": (3, 4, 4), "empty": (0, 9), "one_row": (1, 9), "odd": (3, 7, 5), "big": (2, 16411),
              "batch1": (5, 9), "batch2": (2, 9, 3), "batch3": (2, 9, 3, 2), "batch4": (1, 9, 2, 2, 3)}
    s = shapes[shape]
    return {"input": Arg(s, aliases=("logits",)),
            "target": Arg((s[0],) + s[2:], "index", high=s[1], ignore_frac=0.25, aliases=("labels",))}


CE_OPTIONS = dict(reduction="none", label_smoothing=0.1, z_loss_weight=1e-3, softcap=5.0)


def _cross_entropy_targets():
    import hubfuse.cross_entropy as ce
    from hubfuse.cross_entropy import layers as L

    p = Problem("cross_entropy", _ce_args, primary="logits", index="labels",
                oracle=lambda a, lp: _ce64(a["logits"], a["labels"]))
    _target("cross_entropy(inplace=False)", "op", p,
            lambda s: lambda a: ce.cross_entropy(a["logits"], a["labels"], inplace=False), dtypes=HALF + ("fp64",))
    _target("cross_entropy(inplace=True)", "op", p, lambda s: lambda a: ce.cross_entropy(a["logits"], a["labels"]),
            dtypes=HALF + ("fp64",), inplace=("logits",), layouts_ok=False,
            note="inplace=True with a gradient needs contiguous logits (ValueError otherwise)")
    opts = Problem("cross_entropy_options", _ce_args, primary="logits", index="labels",
                   oracle=lambda a, lp: _ce64(a["logits"], a["labels"], **CE_OPTIONS))
    _target("cross_entropy(reduction='none', smoothing, z-loss, softcap)", "op", opts,
            lambda s: lambda a: ce.cross_entropy(a["logits"], a["labels"], inplace=False, **CE_OPTIONS),
            dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"),
            layout_roles=("input",))

    lce = Problem("linear_cross_entropy", _lce_args, primary="hidden", index="labels",
                  oracle=lambda a, lp: _ce64(F.linear(a["hidden"], a["weight"], a["bias"]), a["labels"]))
    _target("linear_cross_entropy", "op", lce, lambda s: lambda a: ce.linear_cross_entropy(
        a["hidden"], a["weight"], a["labels"], a["bias"], chunk_size=4), dtypes=HALF + ("fp64",))
    lce_opts = Problem("linear_cross_entropy_options", _lce_args, primary="hidden", index="labels",
                       oracle=lambda a, lp: _ce64(F.linear(a["hidden"], a["weight"], a["bias"]), a["labels"],
                                                  **CE_OPTIONS))
    _target("linear_cross_entropy(reduction='none', smoothing, z-loss, softcap)", "op", lce_opts,
            lambda s: lambda a: ce.linear_cross_entropy(a["hidden"], a["weight"], a["labels"], a["bias"],
                                                        chunk_size=4, **CE_OPTIONS),
            dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"), layout_roles=("input",))
    names = ("hidden", "weight", "labels", "bias")
    _target("LinearCrossEntropyLoss (Layer)", "layer", lce,
            lambda s: _layer(L.LinearCrossEntropyLossLayout(), {}, names, L.LinearCrossEntropyLoss.forward),
            dtypes=HALF + ("fp64",))
    _target("LinearCrossEntropyLossLayout", "layout", lce,
            lambda s: _layer(L.LinearCrossEntropyLossLayout(), {}, names), dtypes=HALF + ("fp64",),
            axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",))

    module = Problem("CrossEntropyLoss", _ce_module_args, primary="input", index="target",
                     oracle=lambda a, lp: F.cross_entropy(a["input"], a["target"], ignore_index=IGNORE))
    _target("CrossEntropyLoss (Layer)", "layer", module,
            lambda s: _layer(nn.CrossEntropyLoss(), {}, ("input", "target"), L.CrossEntropyLoss.forward),
            dtypes=HALF + ("fp64",))
    _target("CrossEntropyLossLayout", "layout", module,
            lambda s: _layer(L.CrossEntropyLossLayout(), {}, ("input", "target")), dtypes=HALF + ("fp64",),
            axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",))


# ----------------------------------------------------------------------------------------------- MoE

def _moe_args(shape):
    T, K, E, H, I = 5, 2, 4, 16, 8
    if shape == "one_row":
        T = 1
    elif shape == "odd":
        T, E, H, I = 7, 3, 13, 7
    elif shape == "big":  # above the kernels' 64-wide tiles
        T, E, H, I = 3, 2, 80, 72
    elif shape == "empty":
        T = 0
    lead = LEAD[shape] if shape.startswith("batch") and shape != "batch1" else (T,)
    return {"hidden_states": Arg(lead + (H,)),
            "top_k_index": Arg(lead + (K,), "index", high=E, bad_high=E + 1),
            "top_k_weights": Arg(lead + (K,), scale=0.5),
            "gate_up_proj": Arg((E, 2 * I, H), "param", scale=0.3),
            "down_proj": Arg((E, H, I), "param", scale=0.3)}


def _moe_targets():
    import hubfuse.moe as moe
    from hubfuse.moe import layers as L

    p = Problem("moe_experts", _moe_args, primary="hidden_states", index="top_k_index",
                extra_values=("id_sentinel",),
                oracle=lambda a, lp: moe.experts_hf(a["hidden_states"], a["top_k_index"], a["top_k_weights"],
                                                    a["gate_up_proj"], a["down_proj"]))
    names = ("hidden_states", "top_k_index", "top_k_weights")
    params = {"gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}

    def layout(s):
        E, two_i, H = s["gate_up_proj"].shape
        return L.GroupedGemmExpertsLayout(_config(num_experts=E, hidden_size=H, moe_intermediate_size=two_i // 2,
                                                  hidden_act="silu"))

    shapes = ("base", "one_row", "odd", "big", "batch1")
    bf16 = "bf16 is not run under the Triton interpreter (its bf16 tl.dot is wrong; the GPU variant runs it)"
    _target("moe_experts", "op", p, lambda s: lambda a: moe.moe_experts(*(a[n] for n in names + tuple(params))),
            shapes=shapes, interp_skip_dtypes=("bf16",), note=bf16)
    _target("GroupedGemmExperts (Layer)", "layer", p,
            lambda s: _layer(layout(s), params, names, L.GroupedGemmExperts.forward), shapes=shapes,
            interp_skip_dtypes=("bf16",))
    _target("hubfuse_experts_forward (experts_implementation)", "layer", p,
            lambda s: _layer(layout(s), params, names, L.hubfuse_experts_forward), shapes=shapes,
            axes=("dtype", "values", "grad"), interp_skip_dtypes=("bf16",))
    _target("GroupedGemmExpertsLayout", "layout", p, lambda s: _layer(layout(s), params, names),
            dtypes=HALF + ("fp64",), shapes=shapes, axes=("dtype", "shape", "layout", "values", "grad"),
            paths=("ref",), compile=False,
            note="HF's eager loop (data-dependent expert loop): not compiled with fullgraph, as the HF class")


# ----------------------------------------------------------------------------------------------- rotary

def _rope_dims(shape):
    """(B, Hq, Hk, S, D, R, batch of cos)."""
    return {"one_row": (1, 1, 1, 1, 8, 8, 1), "odd": (3, 3, 1, 7, 10, 6, 3), "big": (1, 1, 1, 2, 4100, 4100, 1),
            "batch1": (2, 3, 1, 5, 8, 8, 1), "empty": (2, 0, 1, 5, 8, 8, 2)}.get(shape, (2, 3, 1, 5, 8, 8, 2))


def _rope_args(heads_first):
    def args(shape):
        if shape in ("batch3", "batch4"):
            return None
        B, Hq, Hk, S, D, R, Bc = _rope_dims(shape)
        extra = (2,) if shape == "batch2" else ()  # a 5-D q: not HF's (B, H, S, D)
        q = extra + ((B, Hq, S, D) if heads_first else (B, S, Hq, D))
        k = extra + ((B, Hk, S, D) if heads_first else (B, S, Hk, D))
        return {"q": Arg(q), "k": Arg(k), "cos": Arg((Bc, S, R), "buffer"), "sin": Arg((Bc, S, R), "buffer")}
    return args


def _norm_rope_args(shape):
    if shape in ("batch3", "batch4"):
        return None
    B, Hq, Hk, S, D, R, Bc = _rope_dims(shape)
    if shape == "odd":
        R = 4
    extra = (2,) if shape == "batch2" else ()
    return {"q": Arg(extra + (B, S, Hq, D)), "k": Arg(extra + (B, S, Hk, D)),
            "q_weight": Arg((D,), "param"), "k_weight": Arg((D,), "param"),
            "cos": Arg((Bc, S, R), "buffer"), "sin": Arg((Bc, S, R), "buffer")}


def _flat(outputs):
    return torch.cat([t.reshape(-1) for t in outputs])


# attention Layouts: "qk_norm" (Qwen3), "gated" (Qwen3.5-MoE), "rope" (Llama: no q/k norm)
def _attention_args(kind):
    gated = kind == "gated"

    def args(shape):
        B, S = {"one_row": (1, 1), "odd": (3, 7), "batch1": (1, 5)}.get(shape, (2, 5))
        if shape not in ("base", "one_row", "odd", "batch1"):
            return None
        D = 16 if gated else 8
        R = 4 if gated else D
        hidden, heads, kv_heads = 32, 4, 2
        q_rows = heads * D * (2 if gated else 1)
        # the fused op names its inputs q / k: the projections of hidden_states
        out = {"hidden_states": Arg((B, S, hidden), aliases=("q", "k")), "cos": Arg((B, S, R), "buffer"),
               "sin": Arg((B, S, R), "buffer"),
               "q_proj": Arg((q_rows, hidden), "param", scale=0.3),
               "k_proj": Arg((kv_heads * D, hidden), "param", scale=0.3),
               "v_proj": Arg((kv_heads * D, hidden), "param", scale=0.3),
               "o_proj": Arg((hidden, heads * D), "param", scale=0.3)}
        if kind != "rope":
            out.update(q_norm=Arg((D,), "param"), k_norm=Arg((D,), "param"))
        return out
    return args


def _attention_config(kind):
    if kind == "gated":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig as C

        extra = dict(partial_rotary_factor=0.25, layer_types=["full_attention"], num_hidden_layers=1)
    elif kind == "rope":
        from transformers import LlamaConfig as C

        extra = dict(num_hidden_layers=1)
    else:
        from transformers import Qwen3Config as C

        extra = dict(num_hidden_layers=1)
    config = C(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16 if kind == "gated" else 8,
               rms_norm_eps=EPS, attention_bias=False, attention_dropout=0.0, vocab_size=16, **extra)
    config._attn_implementation = "eager"
    return config


def _attention_params(kind):
    names = ("q_proj", "k_proj", "v_proj", "o_proj") + (() if kind == "rope" else ("q_norm", "k_norm"))
    return {f"{n}.weight": n for n in names}


def _attention_oracle(kind):
    def oracle(a, lp):
        if kind == "gated":
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention as HF
        elif kind == "rope":
            from transformers.models.llama.modeling_llama import LlamaAttention as HF
        else:
            from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as HF
        module = HF(_attention_config(kind), 0).double()
        params = {p: a[n] for p, n in _attention_params(kind).items()}
        return torch.func.functional_call(module, params, (a["hidden_states"], (a["cos"], a["sin"]), None))[0]
    return oracle


def _rotary_targets():
    import hubfuse.rotary as rotary
    from hubfuse.rotary import layers as L
    from hubfuse.rotary.reference import STANDARD, ZERO_CENTERED

    hf = rotary.apply_rotary_pos_emb_hf
    rope = Problem("rope", _rope_args(True), primary="q",
                   oracle=lambda a, lp: hf(a["q"], a["k"], a["cos"], a["sin"]))
    qkcs = lambda a: (a["q"], a["k"], a["cos"], a["sin"])  # noqa: E731
    shapes = ("base", "one_row", "odd", "big", "batch1")
    _target("apply_rotary_pos_emb", "op", rope, lambda s: lambda a: rotary.apply_rotary_pos_emb(*qkcs(a)),
            shapes=shapes, dtypes=HALF + ("mixed",))
    _target("apply_rotary_pos_emb(unsqueeze_dim=2)", "op",
            Problem("rope_bshd", _rope_args(False), primary="q",
                    oracle=lambda a, lp: hf(a["q"], a["k"], a["cos"], a["sin"], 2)),
            lambda s: lambda a: rotary.apply_rotary_pos_emb(*qkcs(a), unsqueeze_dim=2), shapes=shapes,
            dtypes=HALF + ("mixed",))
    flat = Problem("rope_flat", _rope_args(True), primary="q",
                   oracle=lambda a, lp: _flat(hf(a["q"], a["k"], a["cos"], a["sin"])))
    _target("apply_rotary_pos_emb_flat", "op", flat, lambda s: lambda a: rotary.apply_rotary_pos_emb_flat(*qkcs(a)),
            shapes=shapes, dtypes=HALF + ("mixed",))
    _target("apply_rotary_pos_emb_ (in place)", "op", rope, lambda s: lambda a: rotary.apply_rotary_pos_emb_(*qkcs(a)),
            shapes=shapes, dtypes=HALF + ("mixed",), inplace=("q", "k"), layouts_ok=False,
            grads=("default", "none", "inputs"),
            note="in place: q and k need a unit-stride last dim; cos/sin that require grad raise")
    _target("RotaryPosEmb (Layer)", "layer", rope, lambda s: lambda a: L.RotaryPosEmb()(*qkcs(a)),
            shapes=shapes, dtypes=HALF + ("mixed",))

    args = lambda a: (a["q"], a["k"], a["q_weight"], a["k_weight"], a["cos"], a["sin"])  # noqa: E731
    for name, mode in (("qk_norm_rope", STANDARD), ("qk_norm_rope_zero_centered", ZERO_CENTERED)):
        p = Problem(name, _norm_rope_args, primary="q",
                    oracle=lambda a, lp, mode=mode: rotary.qk_norm_rope_hf(*args(a), EPS, mode))
        fn = getattr(rotary, name)
        _target(name, "op", p, lambda s, fn=fn: lambda a: fn(*args(a)), shapes=shapes, dtypes=HALF + ("mixed",))
    p = Problem("qk_norm_rope_flat", _norm_rope_args, primary="q",
                oracle=lambda a, lp: _flat(rotary.qk_norm_rope_hf(*args(a), EPS, STANDARD)))
    _target("qk_norm_rope_flat", "op", p, lambda s: lambda a: rotary.qk_norm_rope_flat(*args(a)), shapes=shapes,
            dtypes=HALF + ("mixed",))

    module_axes = ("dtype", "shape", "layout", "values", "grad")
    for kind, layer, layout in (("qk_norm", L.QKNormRopeAttention, L.QKNormRopeAttentionLayout),
                                ("gated", L.GatedQKNormRopeAttention, L.GatedQKNormRopeAttentionLayout),
                                ("rope", L.RopeAttention, L.RopeAttentionLayout)):
        p = Problem(layout.__name__, _attention_args(kind), primary="hidden_states", oracle=_attention_oracle(kind))

        def build(s, kind=kind, layout=layout, forward=None):
            module = layout(_attention_config(kind), 0)
            if forward is not None:
                module.forward = types.MethodType(forward, module)
            return lambda a: torch.func.functional_call(
                module, {p_: a[n] for p_, n in _attention_params(kind).items()},
                (a["hidden_states"], (a["cos"], a["sin"]), None))[0]

        shapes_ = ("base", "one_row", "odd", "batch1")
        _target(f"{layer.__name__} (Layer)", "layer", p,
                lambda s, build=build, layer=layer: build(s, forward=layer.forward),
                shapes=shapes_, axes=module_axes, layout_roles=("input",), dtype_values=("fp16", "bf16", "fp64"),
                note="an attention module: the projections are torch Linears, as in HF (no device / integer / "
                     "mixed-dtype cells: torch's own errors)")
        _target(layout.__name__, "layout", p, build, shapes=shapes_, dtypes=HALF + ("fp64",), axes=module_axes,
                layout_roles=("input",), paths=("ref",))



# dense decoder layers: "qwen3" (q/k norm), "qwen2" (RoPE alone, biased q/k/v)
def _decoder_args(kind):
    def args(shape):
        B, S = {"one_row": (1, 1), "odd": (3, 7), "batch1": (1, 5)}.get(shape, (2, 5))
        if shape not in ("base", "one_row", "odd", "batch1"):
            return None
        D, R, hidden, heads, kv_heads, inter = 8, 8, 32, 4, 2, 48
        out = {"hidden_states": Arg((B, S, hidden), aliases=("x",)), "cos": Arg((B, S, R), "buffer"),
               "sin": Arg((B, S, R), "buffer"),
               "input_layernorm": Arg((hidden,), "param"), "post_attention_layernorm": Arg((hidden,), "param"),
               "q_proj": Arg((heads * D, hidden), "param", scale=0.3),
               "k_proj": Arg((kv_heads * D, hidden), "param", scale=0.3),
               "v_proj": Arg((kv_heads * D, hidden), "param", scale=0.3),
               "o_proj": Arg((hidden, heads * D), "param", scale=0.3),
               "gate_up_proj": Arg((2 * inter, hidden), "param", scale=0.3),
               "down_proj": Arg((hidden, inter), "param", scale=0.3)}
        if kind == "qwen3":
            out.update(q_norm=Arg((D,), "param"), k_norm=Arg((D,), "param"))
        else:
            out.update(q_bias=Arg((heads * D,), "param"), k_bias=Arg((kv_heads * D,), "param"),
                       v_bias=Arg((kv_heads * D,), "param"))
        return out
    return args


def _decoder_config(kind):
    from transformers import Qwen2Config, Qwen3Config

    config = (Qwen3Config if kind == "qwen3" else Qwen2Config)(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        rms_norm_eps=EPS, attention_dropout=0.0, vocab_size=16, num_hidden_layers=1)
    config._attn_implementation = "sdpa"  # the node's condition (another implementation: the per-op path)
    return config


def _decoder_params(kind, split_gate_up=False):
    names = {"input_layernorm.weight": "input_layernorm", "post_attention_layernorm.weight": "post_attention_layernorm",
             **{f"self_attn.{n}.weight": n for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
             "mlp.down_proj.weight": "down_proj"}
    if not split_gate_up:
        names["mlp.gate_up_proj.weight"] = "gate_up_proj"
    if kind == "qwen3":
        names.update({"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"})
    else:
        names.update({f"self_attn.{n}_proj.bias": f"{n}_bias" for n in "qkv"})
    return names


def _decoder_oracle(kind):
    def oracle(a, lp):
        if kind == "qwen3":
            from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as HF
        else:
            from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as HF
        module = HF(_decoder_config(kind), 0).double()
        params = {p: a[n] for p, n in _decoder_params(kind, split_gate_up=True).items()}
        params["mlp.gate_proj.weight"], params["mlp.up_proj.weight"] = a["gate_up_proj"].chunk(2, dim=0)
        return torch.func.functional_call(module, params, (a["hidden_states"],),
                                          {"position_embeddings": (a["cos"], a["sin"])})
    return oracle


def _decoder_layer_targets():
    from hubfuse.decoder_layer import layers as L

    module_axes = ("dtype", "shape", "layout", "values", "grad")
    for kind in ("qwen3", "qwen2"):
        p = Problem(f"DecoderLayerLayout ({kind})", _decoder_args(kind), primary="hidden_states",
                    oracle=_decoder_oracle(kind))

        def build(s, kind=kind, forward=None):
            module = L.DecoderLayerLayout(_decoder_config(kind), 0)
            if forward is not None:
                module.forward = types.MethodType(forward, module)
            return lambda a: torch.func.functional_call(
                module, {p_: a[n] for p_, n in _decoder_params(kind).items()}, (a["hidden_states"],),
                {"position_embeddings": (a["cos"], a["sin"])})

        shapes = ("base", "one_row", "odd", "batch1")
        _target(f"DecoderLayer (Layer, {kind})", "layer", p,
                lambda s, build=build: build(s, forward=L.DecoderLayer.forward), shapes=shapes, axes=module_axes,
                layout_roles=("input",), dtype_values=("fp16", "bf16", "fp64"),
                note="a decoder layer: the projections are torch Linears, as in HF (no device / integer / "
                     "mixed-dtype cells: torch's own errors)")
        _target(f"DecoderLayerLayout ({kind})", "layout", p, build, shapes=shapes, dtypes=HALF + ("fp64",),
                axes=module_axes, layout_roles=("input",), paths=("ref",))

# ----------------------------------------------------------------------------------------------- load balancing

LBL_LAYERS, LBL_TOP_K = 3, 2
LBL_AXES = ("dtype", "shape", "layout", "values", "grad")
LBL_NOTE = ("no device axis: as in HF, the other layers and the mask are moved to the first layer's device (a "
            "meta tensor cannot stand in for that move)")


def _lbl_dims(shape):
    """(tokens, experts, mask shape)."""
    masks = {"batch1": (12,), "batch2": (3, 4), "batch3": (1, 3, 4), "batch4": (1, 1, 3, 4)}
    if shape in masks:
        return 12, 6, masks[shape]
    return {"one_row": (1, 6, (1,)), "odd": (7, 5, (7,)), "big": (4, 8193, (4,)), "empty": (0, 6, (0,))}.get(
        shape, (12, 6, (3, 4)))


def _lbl_args(stacked):
    def args(shape):
        T, E, mask = _lbl_dims(shape)
        if stacked:
            out = {"gate_logits": Arg((LBL_LAYERS, T, E))}
        else:
            out = {f"gate_logits[{i}]": Arg((T, E), aliases=("gate_logits",)) for i in range(LBL_LAYERS)}
        out["attention_mask"] = Arg(mask, "mask")
        return out
    return args


def _lbl_oracle(stacked):
    def oracle(a, lp):
        layers = list(a["gate_logits"].unbind(0)) if stacked else [a[f"gate_logits[{i}]"] for i in range(LBL_LAYERS)]
        low = list(lp["gate_logits"].unbind(0)) if stacked else [lp[f"gate_logits[{i}]"] for i in range(LBL_LAYERS)]
        E = layers[0].shape[-1]
        mask = a["attention_mask"].reshape(-1).double()
        tokens = torch.zeros(E, dtype=torch.float64)
        probs_sum = torch.zeros(E, dtype=torch.float64)
        rows = 0.0
        for x64, x in zip(layers, low):
            probs64 = torch.softmax(x64, -1)
            # selection on the probabilities rounded to the logits' dtype (HF's softmax returns that dtype)
            sel = _select(torch.softmax(x.float(), -1).to(x.dtype).double().cpu(), LBL_TOP_K)
            tokens = tokens + torch.zeros(E, dtype=torch.float64).scatter_add_(
                0, sel.reshape(-1), mask.repeat_interleave(LBL_TOP_K))
            probs_sum = probs_sum + (probs64 * mask[:, None]).sum(0)
            rows = rows + mask.sum()
        return E * torch.sum((tokens / rows) * (probs_sum / rows))
    return oracle


def _router_args(shape):
    T, E = {"one_row": (1, 6), "odd": (9, 5), "big": (2, 8193), "empty": (0, 6)}.get(shape, (7, 6))
    if shape in ("batch2", "batch3", "batch4"):
        return {"router_logits": Arg(LEAD[shape] + (E,))}
    return {"router_logits": Arg((T, E))}


def _router_oracle(a, lp):
    x = a["router_logits"]
    return _top_k_rows(torch.softmax(lp["router_logits"].float(), -1), torch.softmax(x, -1), LBL_TOP_K, True)


def _topk_router_args(shape):
    lead = LEAD[shape]
    H, E = (13, 5) if shape == "odd" else ((8, 8193) if shape == "big" else (16, 6))
    return {"hidden_states": Arg(lead + (H,)), "weight": Arg((E, H), "param", scale=0.3)}


def _topk_router_oracle(normalize):
    def oracle(a, lp):
        H = a["weight"].shape[1]
        logits64 = F.linear(a["hidden_states"].reshape(-1, H), a["weight"])
        logits = F.linear(lp["hidden_states"].reshape(-1, H), lp["weight"])  # the GEMM in the inputs' dtype
        scores, index = _top_k_rows(torch.softmax(logits.float(), -1), torch.softmax(logits64, -1), LBL_TOP_K,
                                    normalize)
        return logits64, scores, index
    return oracle


def _load_balancing_targets():
    import hubfuse.load_balancing_loss as lbl
    from hubfuse.load_balancing_loss import layers as L

    def layers_of(a):
        return [a[f"gate_logits[{i}]"] for i in range(LBL_LAYERS)]

    p = Problem("load_balancing_loss", _lbl_args(False), primary="gate_logits[0]", oracle=_lbl_oracle(False))
    _target("load_balancing_loss", "op", p, lambda s: lambda a: lbl.load_balancing_loss(
        layers_of(a), a["gate_logits[0]"].shape[-1], LBL_TOP_K, a["attention_mask"]),
        shapes=NO_BIG, axes=LBL_AXES, note=LBL_NOTE)
    _target("load_balancing_loss_func", "op", p, lambda s: lambda a: lbl.load_balancing_loss_func(
        tuple(layers_of(a)), a["gate_logits[0]"].shape[-1], LBL_TOP_K, a["attention_mask"]),
        shapes=NO_BIG, axes=LBL_AXES)
    stacked = Problem("load_balancing_loss_stacked", _lbl_args(True), primary="gate_logits", oracle=_lbl_oracle(True))
    _target("load_balancing_loss(stacked tensor)", "op", stacked, lambda s: lambda a: lbl.load_balancing_loss(
        a["gate_logits"], a["gate_logits"].shape[-1], LBL_TOP_K, a["attention_mask"]),
        shapes=NO_BIG, axes=LBL_AXES)

    router = Problem("softmax_topk", _router_args, primary="router_logits", oracle=_router_oracle)
    _target("softmax_topk", "op", router, lambda s: lambda a: lbl.softmax_topk(a["router_logits"], LBL_TOP_K),
            shapes=("base", "one_row", "odd", "batch1"))

    for normalize in (True, False):
        p = Problem(f"topk_router(normalize={normalize})", _topk_router_args, primary="hidden_states",
                    oracle=_topk_router_oracle(normalize))

        def host(s, normalize=normalize):
            E, H = s["weight"].shape
            return L.TopKRouterLayout(_config(num_experts_per_tok=LBL_TOP_K, num_experts=E, norm_topk_prob=normalize,
                                              hidden_size=H))

        if normalize:
            _target("topk_router", "op", p, lambda s: lambda a: lbl.topk_router(
                a["hidden_states"], a["weight"], LBL_TOP_K), shapes=NO_BIG)
            _target("SoftmaxTopKRouter (Layer)", "layer", p,
                    lambda s: _layer(host(s), {"weight": "weight"}, ("hidden_states",), L.SoftmaxTopKRouter.forward),
                    shapes=NO_BIG)
        _target(f"TopKRouter (Layer, norm_topk_prob={normalize})", "layer", p,
                lambda s, host=host: _layer(host(s), {"weight": "weight"}, ("hidden_states",), L.TopKRouter.forward),
                shapes=NO_BIG)
        _target(f"TopKRouterLayout(norm_topk_prob={normalize})", "layout", p,
                lambda s, host=host: _layer(host(s), {"weight": "weight"}, ("hidden_states",)),
                dtypes=HALF + ("fp64",), axes=("dtype", "shape", "layout", "values", "grad"), paths=("ref",),
                skip_layouts=("expanded:weight",),
                note="no expanded weight (identical experts: exact ties, which torch.topk on CPU breaks in no "
                     "fixed order; the kernels take the lower index)")


# ----------------------------------------------------------------------------------------------- gated delta net

GDN_H, GDN_HV, GDN_K, GDN_V, GDN_W = 1, 2, 16, 8, 4
GDN_NOTE = ("g and beta enter as logsigmoid / sigmoid of the cell's values (a log decay <= 0, beta in (0, 1)); "
            "bf16 is not run under the Triton interpreter (its bf16 tl.dot is wrong; the GPU variant runs it)")


def _gdn_dims(shape):
    """(B, S, K, V): sequence lengths 1, 2 and 67 (odd, past one 64-token chunk) with batch > 1, head dims past
    the kernels' 256 limit ("big")."""
    return {"base": (2, 5, GDN_K, GDN_V), "one_row": (3, 1, GDN_K, GDN_V), "odd": (2, 67, 13, 7),
            "big": (1, 3, 257, GDN_V), "batch1": (1, 5, GDN_K, GDN_V), "batch2": (2, 2, GDN_K, GDN_V),
            "empty": (2, 0, GDN_K, GDN_V)}.get(shape)


# packed sequences: total tokens, offsets (an empty sequence in the base case)
GDN_PACKED = {"base": (9, (0, 2, 2, 9)), "one_row": (1, (0, 1)), "odd": (67, (0, 1, 66, 67)), "batch1": (5, (0, 5))}


def _gdn_rule_args(packed, gates):
    def args(shape):
        if packed:
            if shape not in GDN_PACKED:
                return None
            T, offsets = GDN_PACKED[shape]
            B, S, N, K, V = 1, T, len(offsets) - 1, GDN_K, GDN_V
        else:
            if _gdn_dims(shape) is None:
                return None
            B, S, K, V = _gdn_dims(shape)
            N = B
        H, HV = GDN_H, GDN_HV
        out = {"q": Arg((B, S, H, K), aliases=("query",)), "k": Arg((B, S, H, K), aliases=("key",)),
               "v": Arg((B, S, HV, V), aliases=("value",))}
        if gates:
            out.update({"a": Arg((B, S, HV)), "b": Arg((B, S, HV)), "A_log": Arg((HV,), "param", scale=0.5),
                        "dt_bias": Arg((HV,), "param")})
        else:
            out.update({"g": Arg((B, S, HV)), "beta": Arg((B, S, HV))})
        out["initial_state"] = Arg((N, HV, K, V), scale=0.5)
        if packed:
            out["cu_seqlens"] = Arg((N + 1,), "index", high=S + 1, bad_high=S + 1, values=offsets)
        return out
    return args


def _check_offsets64(cu, total):
    """What the ops require of cu_seqlens (the float64 oracle refuses the rest as they do)."""
    if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 2:
        raise TypeError("cu_seqlens must be a 1-D int32 / int64 tensor of at least 2 offsets")
    c = cu.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at {total}")
    return c


def _gdn_rule64(q, k, v, g, beta, h0, cu=None):
    """transformers' chunked rule in float64, key heads repeated, per packed sequence (an empty one passes its
    state through); returns (o, final state)."""
    from hubfuse.gated_delta_net import reference as R

    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    bounds = [0, q.shape[1]] if cu is None else _check_offsets64(cu, q.shape[1])
    outs, states = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        h = h0 if cu is None else h0[i:i + 1]
        if s == e:
            states.append(h)
            continue
        o, ht = R.chunk_gated_delta_rule_hf(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                            initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            compute_dtype=torch.float64)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _gdn_gates64(a):
    if "a" in a:
        return (-a["A_log"].exp() * F.softplus(a["a"] + a["dt_bias"]), torch.sigmoid(a["b"]))
    return F.logsigmoid(a["g"]), torch.sigmoid(a["beta"])


def _gdn_conv_args(layout, packed=False):
    """layout "bsc": (B, S, C) channels-last; "bcs": transformers' (B, C, S); "update": (B, C, L) new tokens and
    the (B, C, W - 1) state."""
    def args(shape):
        if packed:
            if shape not in GDN_PACKED:
                return None
            T, offsets = GDN_PACKED[shape]
            B, S, C = 1, T, 12
        else:
            dims = {"base": (2, 5, 12), "one_row": (2, 1, 12), "odd": (3, 7, 13), "batch1": (1, 6, 12),
                    "batch2": (2, 2, 12), "empty": (2, 0, 12)}.get(shape)
            if dims is None:
                return None
            B, S, C = dims
        x = {"bsc": (B, S, C), "bcs": (B, C, S), "update": (B, C, min(S, 3))}[layout]
        out = {"hidden_states": Arg(x, aliases=("x",))}
        if layout == "update":
            out["conv_state"] = Arg((B, C, GDN_W - 1))
        out.update({"weight": Arg((C, GDN_W), "param", scale=0.5), "bias": Arg((C,), "param", scale=0.5)})
        if packed:
            out["cu_seqlens"] = Arg((len(offsets),), "index", high=S + 1, bad_high=S + 1, values=offsets)
        return out
    return args


def _conv64(x, weight, bias, cu=None):
    """transformers' causal_conv1d_fn + SiLU in float64 over channels-last x, per packed sequence."""
    from hubfuse.gated_delta_net import reference as R

    bounds = [0, x.shape[1]] if cu is None else _check_offsets64(cu, x.shape[1])
    return torch.cat([R.causal_conv1d_fn_hf(x[:, s:e].transpose(1, 2), weight, bias, "silu").transpose(1, 2)
                      for s, e in zip(bounds[:-1], bounds[1:]) if e > s], 1)


def _gdn_core_args(packed):
    def args(shape):
        if packed:
            if shape not in GDN_PACKED:
                return None
            T, offsets = GDN_PACKED[shape]
            B, S, K, V = 1, T, GDN_K, GDN_V
        else:
            if _gdn_dims(shape) is None:
                return None
            B, S, K, _ = _gdn_dims(shape)
            K = K if K > 256 else GDN_K  # one value head dim: the build reads the key head dim off the width
        C = 2 * GDN_H * K + GDN_HV * GDN_V
        out = {"mixed_qkv": Arg((B, S, C)), "conv_weight": Arg((C, GDN_W), "param", scale=0.5),
               "a": Arg((B, S, GDN_HV)), "b": Arg((B, S, GDN_HV)), "A_log": Arg((GDN_HV,), "param", scale=0.5),
               "dt_bias": Arg((GDN_HV,), "param")}
        if packed:
            out["cu_seqlens"] = Arg((len(offsets),), "index", high=S + 1, bad_high=S + 1, values=offsets)
        return out
    return args


def _gdn_core64(a, lp):
    cu = a.get("cu_seqlens")
    mixed = a["mixed_qkv"]
    B, S, C = mixed.shape
    HV, V = a["a"].shape[-1], GDN_V
    K = (C - HV * V) // (2 * GDN_H)
    conv = _conv64(mixed, a["conv_weight"], None, cu)
    q, k, v = torch.split(conv, [GDN_H * K, GDN_H * K, HV * V], dim=-1)
    g, beta = _gdn_gates64(a)
    return _gdn_rule64(q.reshape(B, S, GDN_H, K), k.reshape(B, S, GDN_H, K), v.reshape(B, S, HV, V), g, beta,
                       torch.zeros(B if cu is None else cu.numel() - 1, HV, K, V, dtype=torch.float64), cu)[0]


def _gdn_module_config():
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(hidden_size=32, linear_num_key_heads=GDN_H, linear_num_value_heads=GDN_HV,
                                linear_key_head_dim=GDN_K, linear_value_head_dim=GDN_V, linear_conv_kernel_dim=GDN_W,
                                rms_norm_eps=EPS, num_hidden_layers=1, layer_types=["linear_attention"],
                                vocab_size=16, hidden_act="silu")


GDN_PARAMS = {"in_proj_qkv.weight": "in_proj_qkv", "in_proj_z.weight": "in_proj_z", "in_proj_b.weight": "in_proj_b",
              "in_proj_a.weight": "in_proj_a", "conv1d.weight": "conv1d", "dt_bias": "dt_bias", "A_log": "A_log",
              "norm.weight": "norm", "out_proj.weight": "out_proj"}


def _gdn_module_args(shape):
    dims = {"base": (2, 5), "one_row": (2, 1), "odd": (3, 7), "batch1": (1, 5), "batch2": (2, 2)}.get(shape)
    if dims is None:
        return None
    hidden, key, value = 32, GDN_H * GDN_K, GDN_HV * GDN_V
    # the fused op names its input mixed_qkv: the projection of hidden_states
    return {"hidden_states": Arg(dims + (hidden,), aliases=("mixed_qkv",)),
            "in_proj_qkv": Arg((2 * key + value, hidden), "param", scale=0.3),
            "in_proj_z": Arg((value, hidden), "param", scale=0.3),
            "in_proj_b": Arg((GDN_HV, hidden), "param", scale=0.3),
            "in_proj_a": Arg((GDN_HV, hidden), "param", scale=0.3),
            "conv1d": Arg((2 * key + value, 1, GDN_W), "param", scale=0.5), "dt_bias": Arg((GDN_HV,), "param"),
            "A_log": Arg((GDN_HV,), "param", scale=0.5), "norm": Arg((GDN_V,), "param"),
            "out_proj": Arg((32, value), "param", scale=0.3)}


def _gdn_module(forward=None):
    from hubfuse.gated_delta_net import layers as L

    module = L.GatedDeltaNetLayout(_gdn_module_config(), 0)
    if forward is not None:
        module.forward = types.MethodType(forward, module)
    return lambda a: torch.func.functional_call(module, {p: a[n] for p, n in GDN_PARAMS.items()},
                                                (a["hidden_states"],))


def _gdn_module64(a, lp):
    """The Layout's forward (transformers' torch code) on the float64 inputs (its rule computes in fp32, as
    transformers' does: the oracle is good to fp32 rounding)."""
    return _gdn_module()(a)


def _gated_delta_net_targets():
    import hubfuse.gated_delta_net as gdn
    from hubfuse.gated_delta_net import layers as L

    # the rule's kernels take ~10 s a cell under the interpreter: there, sequence lengths / batch (shape) and the
    # bad values (NaN / inf, cu_seqlens out of range or unsorted); views of the conv output: the core's
    # one-token shape; every axis on the torch path and for the conv
    kw = dict(interp_skip_dtypes=("bf16",), note=GDN_NOTE, kernel_axes=("shape", "values"))
    conv_kw = dict(kw, kernel_axes=None)
    shapes = ("base", "one_row", "odd", "batch1", "batch2")
    rule_names = ("q", "k", "v", "g", "beta")

    def rule_inputs(a):
        g, beta = _gdn_gates64(a)
        return (a["q"], a["k"], a["v"], g, beta)

    for packed in (False, True):
        suffix = "(cu_seqlens)" if packed else ""
        p = Problem(f"gdn_rule{suffix}", _gdn_rule_args(packed, False), primary="q",
                    index="cu_seqlens" if packed else None, extra_values=("id_unsorted",) if packed else (),
                    oracle=lambda a, lp: _gdn_rule64(*rule_inputs(a), a["initial_state"], a.get("cu_seqlens")))

        def call(a, fn=gdn.chunk_gated_delta_rule):
            return fn(*rule_inputs(a), initial_state=a["initial_state"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=a.get("cu_seqlens"))

        _target(f"chunk_gated_delta_rule{suffix}", "op", p, lambda s, call=call: call, shapes=shapes, **kw)
        for layer in (L.ChunkGatedDeltaRule, L.FusedRecurrentGatedDeltaRule) if not packed else ():
            _target(f"{layer.__name__} (Layer)", "layer", p,
                    lambda s, layer=layer: lambda a: layer()(
                        *rule_inputs(a), initial_state=a["initial_state"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=a.get("cu_seqlens")), shapes=shapes, **kw)
        pq = Problem(f"gdn_rule_qwen3_5{suffix}", _gdn_rule_args(packed, True), primary="q",
                     index="cu_seqlens" if packed else None, extra_values=("id_unsorted",) if packed else (),
                     oracle=lambda a, lp: _gdn_rule64(a["q"], a["k"], a["v"], *_gdn_gates64(a), a["initial_state"],
                                                      a.get("cu_seqlens")))
        _target(f"gated_delta_rule_qwen3_5{suffix}", "op", pq, lambda s: lambda a: gdn.gated_delta_rule_qwen3_5(
            a["q"], a["k"], a["v"], a["a"], a["b"], a["A_log"], a["dt_bias"], initial_state=a["initial_state"],
            output_final_state=True, cu_seqlens=a.get("cu_seqlens")), shapes=shapes, **kw)

        pc = Problem(f"causal_conv1d{suffix}", _gdn_conv_args("bsc", packed), primary="hidden_states",
                     index="cu_seqlens" if packed else None, extra_values=("id_unsorted",) if packed else (),
                     oracle=lambda a, lp: _conv64(a["hidden_states"], a["weight"], a["bias"], a.get("cu_seqlens")))
        _target(f"causal_conv1d{suffix}", "op", pc, lambda s: lambda a: gdn.causal_conv1d(
            a["hidden_states"], a["weight"], a["bias"], "silu", a.get("cu_seqlens")), shapes=shapes, **conv_kw)

        pk = Problem(f"gated_delta_net_core{suffix}", _gdn_core_args(packed), primary="mixed_qkv",
                     index="cu_seqlens" if packed else None, extra_values=("id_unsorted",) if packed else (),
                     oracle=_gdn_core64)
        _target(f"gated_delta_net_core{suffix}", "op", pk, lambda s: lambda a: gdn.gated_delta_net_core(
            a["mixed_qkv"], a["conv_weight"], None, a["a"], a["b"], a["A_log"], a["dt_bias"], GDN_H,
            (s["mixed_qkv"].shape[-1] - GDN_HV * GDN_V) // (2 * GDN_H), GDN_V, cu_seqlens=a.get("cu_seqlens")),
            shapes=shapes, **kw)

    pf = Problem("causal_conv1d_fn", _gdn_conv_args("bcs"), primary="hidden_states",
                 oracle=lambda a, lp: _conv64(a["hidden_states"].transpose(1, 2), a["weight"], a["bias"]
                                              ).transpose(1, 2))
    _target("causal_conv1d_fn", "op", pf, lambda s: lambda a: gdn.causal_conv1d_fn(
        a["hidden_states"], a["weight"], a["bias"], "silu"), shapes=shapes, **conv_kw)
    _target("CausalConv1dFn (Layer)", "layer", pf, lambda s: lambda a: L.CausalConv1dFn()(
        a["hidden_states"], a["weight"], a["bias"], "silu"), shapes=shapes, **kw)

    def update64(a, lp):
        from hubfuse.gated_delta_net import reference as R

        state = a["conv_state"].clone()
        out = R.causal_conv1d_update_hf(a["hidden_states"], state, a["weight"], a["bias"], "silu")
        return out, state

    pu = Problem("causal_conv1d_update", _gdn_conv_args("update"), primary="hidden_states", oracle=update64)
    for name, fn in (("causal_conv1d_update", gdn.causal_conv1d_update),
                     ("CausalConv1dUpdate (Layer)", lambda *x: L.CausalConv1dUpdate()(*x))):
        _target(name, "op" if name == "causal_conv1d_update" else "layer", pu,
                lambda s, fn=fn: lambda a: (fn(a["hidden_states"], a["conv_state"], a["weight"], a["bias"], "silu"),
                                            a["conv_state"]),
                shapes=shapes, inplace=("conv_state",), layouts_ok=False, **conv_kw)

    pm = Problem("GatedDeltaNetLayout", _gdn_module_args, primary="hidden_states", oracle=_gdn_module64)
    module_axes = ("dtype", "shape", "layout", "values", "grad")
    _target("GatedDeltaNet (Layer)", "layer", pm, lambda s: _gdn_module(L.GatedDeltaNet.forward), shapes=shapes,
            axes=module_axes, layout_roles=("input",), dtype_values=("fp16", "bf16", "fp64"), **kw)
    _target("GatedDeltaNetLayout", "layout", pm, lambda s: _gdn_module(), shapes=shapes, dtypes=HALF + ("fp64",),
            axes=module_axes, layout_roles=("input",), paths=("ref",), compile=False,
            note="transformers' torch code: not compiled, as HF's Qwen3_5MoeGatedDeltaNet, whose backward under "
                 "torch.compile (aot_eager) raises a view-stride RuntimeError in torch")


def _register():
    if TARGETS:
        return
    _rmsnorm_targets()
    _swiglu_targets()
    _cross_entropy_targets()
    _moe_targets()
    _rotary_targets()
    _decoder_layer_targets()
    _load_balancing_targets()
    _gated_delta_net_targets()
    EXCLUDED.update({
        "*_hf, *_reference": "the torch reference functions: the oracle side (HF's own code)",
        "default_chunk_size": "an int policy function (no tensor input)",
        "enable_fused_loss, disable_fused_loss, fused_loss_enabled, fused_loss_options, install_loss_function, "
        "make_loss_function":
            "model-level hooks (tests/test_cross_entropy_models.py); the loss they install is the cross_entropy op",
        "enable_fused_aux_loss, disable_fused_aux_loss, fused_aux_loss_enabled":
            "model-level hooks (tests/test_load_balancing_loss_models.py); they install load_balancing_loss_func",
        "register_experts_implementation": "registers hubfuse_experts_forward (in the matrix) with transformers",
        "EXPERTS_IMPLEMENTATION_NAME": "a string constant",
        "expert_parallel, shard_experts, set_capacity": "expert parallelism needs a process group and a DeviceMesh "
            "(tests/test_distributed.py); the experts it runs are moe_experts, and it checks the global ids as that "
            "does",
        "group_load_balancing_loss_func": "load_balancing_loss_func with its statistics all-reduced over a process "
            "group (tests/test_distributed.py)",
        "layers": "the module of the Layers and Layouts (each in the matrix)",
        "AdamW": "an optimizer, not a function of tensors with a float64 oracle per cell: its bad-input cases "
            "(torch-only options, sparse, mixed-dtype and non-contiguous gradients, NaN, odd sizes, every dtype "
            "against float64) are tests/test_optim.py",
    })


def public_names() -> dict[str, list[str]]:
    """Every public name of every op package: its functional API (`__all__`) and its Layers / Layouts."""
    import importlib

    from hubfuse.build import families, package_name

    out = {}
    for pkg in map(package_name, families()):
        module = importlib.import_module(f"hubfuse.{pkg}")
        out[pkg] = list(module.__all__) + list(module.layers.__all__)
    out["optim"] = list(importlib.import_module("hubfuse.optim").__all__)  # the umbrella's kernels
    return out


def uncovered_names() -> list[str]:
    """Public names neither in the matrix nor excluded with a reason (must be empty)."""
    _register()
    excluded = {n.strip() for key in EXCLUDED for n in key.split(",")}
    covered = {re.split(r"[ (]", name)[0] for name in TARGETS}
    missing = []
    for pkg, names in public_names().items():
        for name in names:
            if name in covered or name in excluded or name.endswith(("_hf", "_reference")):
                continue
            missing.append(f"{pkg}.{name}")
    return missing


# ----------------------------------------------------------------------------------------------- cells

def _applicable(target: Target, cell: Cell) -> bool:
    p = target.problem
    args = p.args(cell.shape)
    if args is None:
        return False
    floats = [n for n, a in args.items() if a.role in ("input", "param", "buffer")]
    if cell.device != "same" and (cell.device not in args or len(args) < 2):
        return False  # one tensor on another device is no mismatch
    if cell.layout != "contiguous":
        kind, name = cell.layout.split(":", 1)
        if name not in args or args[name].role not in target.layout_roles or cell.layout in target.skip_layouts:
            return False
        shape = args[name].shape
        if 0 in shape or (kind == "transposed" and len(shape) < 2):
            return False
    if cell.values in ("id_low", "id_high", "id_sentinel", "id_unsorted") and (p.index is None
                                                                                 or 0 in args[p.index].shape):
        return False
    if cell.values in ("nan", "inf") and 0 in args[p.primary].shape:
        return False
    if cell.values in ("id_sentinel", "id_unsorted") and cell.values not in p.extra_values:
        return False
    if cell.grad != "default":
        roles = {n: args[n].role for n in floats}
        chosen = {"all": set(roles), "none": set(), "inputs": {n for n, r in roles.items() if r == "input"},
                  "params": {n for n, r in roles.items() if r == "param"}}[cell.grad]
        if cell.grad in ("inputs", "params") and not chosen:
            return False
        if chosen == {n for n, r in roles.items() if r != "buffer"}:
            return False  # the same as the default
    if cell.path == "interp" and cell.dtype in target.interp_skip_dtypes:
        return False
    if cell.mode != "eager" and not target.compile:
        return False
    return True


def _axis_values(target: Target, axis: str) -> list[str]:
    p = target.problem
    if axis == "dtype":
        return list(target.dtype_values)
    if axis == "shape":
        return [v for v in SHAPE_VALUES if v != "base"]
    if axis == "values":
        return ["nan", "inf"] + (["id_low", "id_high"] if p.index else []) + list(p.extra_values)
    if axis == "grad":
        return [v for v in GRAD_VALUES if v != "default"]
    names = list(p.args("base"))
    if axis == "device":
        return names
    if axis == "layout":
        return [f"{kind}:{n}" for n in names for kind in LAYOUT_KINDS]
    raise ValueError(axis)


PAIRS = {"op": 4, "layer": 2, "layout": 3}


def generate(paths=("ref", "interp"), seed: int = 26) -> list[Cell]:
    """The sampled cells, per target and path:
    - the base cell and every axis value alone (on a Triton path only the target's `kernel_axes`, and each
      layout of the main input also without gradients: the forward-only kernels read it in place);
    - a fixed-seed sample of cells with two non-default axis values (PAIRS per kind; on a Triton path for ops
      only);
    - compiled (on every path for ops, on the torch path for Layers and Layouts): the base cell (aot_eager:
      forward and backward graphs) and an out-of-range id where the target takes ids, else a transposed main
      input (eager backend)."""
    _register()
    rng = random.Random(seed)
    cells = []
    for target in TARGETS.values():
        for path in paths:
            if path != "cuda" and path not in target.paths:
                continue
            kernel_path = path != "ref"
            axes = target.kernel_axes if kernel_path else target.axes
            base = Cell(target.name, path, **dict(target.base))
            ofat = [base] + [replace(base, **{axis: v}) for axis in axes for v in _axis_values(target, axis)]
            if kernel_path:  # a forward-only kernel reads its main input in place: each of its layouts again
                ofat += [replace(c, grad="none") for c in ofat if c.layout.endswith(f":{target.problem.primary}")]
            ofat = [c for c in ofat if _applicable(target, c)]
            combos = []
            n_pairs = 0 if kernel_path and target.kind != "op" else PAIRS[target.kind]
            for _ in range(n_pairs * 8):
                if len(combos) == n_pairs or len(target.axes) < 2:
                    break
                a1, a2 = rng.sample(target.axes, 2)
                cell = replace(base, **{a1: rng.choice(_axis_values(target, a1)),
                                        a2: rng.choice(_axis_values(target, a2))})
                if _applicable(target, cell) and cell not in ofat and cell not in combos:
                    combos.append(cell)
            compiled = []
            if target.kind == "op" or not kernel_path:
                compiled.append(replace(base, mode="compile"))
                if target.problem.index:
                    compiled.append(replace(base, mode="compile_fwd", values="id_high"))
                elif "layout" in target.axes:
                    compiled.append(replace(base, mode="compile_fwd", layout=f"transposed:{target.problem.primary}"))
            cells += ofat + combos + [c for c in compiled if _applicable(target, c)]
    return cells


# ----------------------------------------------------------------------------------------------- running a cell

@contextlib.contextmanager
def _path(path: str):
    saved = os.environ.get("TRITON_INTERPRET")
    if path in ("ref", "interp"):
        os.environ["TRITON_INTERPRET"] = "1" if path == "interp" else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _arg_dtype(cell: Cell, name: str, arg: Arg, primary: str) -> torch.dtype:
    if arg.role in ("index", "mask"):
        return torch.int64
    if cell.dtype == "int":
        return torch.int64 if name == primary else torch.float32
    if cell.dtype == "mixed":
        return torch.float16 if arg.role in ("param", "buffer") else torch.float32
    return DTYPES[cell.dtype]


def _master(cell, name, arg, dtype, gen, problem):
    """The argument's values in float64 (index / mask: int64), rounded to its dtype, with the cell's bad values."""
    shape = arg.shape
    if arg.role == "index":
        t = (torch.tensor(arg.values, dtype=torch.int64) if arg.values is not None
             else torch.randint(0, max(arg.high, 1), shape, generator=gen))
        if arg.ignore_frac and t.numel() > 1:
            drop = torch.rand(shape, generator=gen) < arg.ignore_frac
            drop.view(-1)[0] = False
            t[drop] = IGNORE
        if name == problem.index and t.numel():
            bad = {"id_low": -1, "id_high": arg.bad_high if arg.bad_high is not None else arg.high,
                   "id_sentinel": arg.high}.get(cell.values)
            if bad is not None:
                t.view(-1)[-1 if t.numel() > 1 else 0] = bad
            if cell.values == "id_unsorted" and t.numel() > 2:  # offsets: the second one past the third
                t.view(-1)[1] = t.view(-1)[2] + 1
        return t
    if arg.role == "mask":
        t = (torch.rand(shape, generator=gen) < 0.7).to(torch.int64)
        if t.numel():
            t.view(-1)[0] = 1
        return t
    if dtype == torch.int64:
        return torch.randint(-3, 4, shape, generator=gen).double()
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * arg.scale).to(dtype).double()
    if name == problem.primary and t.numel():
        if cell.values == "nan":
            t.view(-1)[0] = float("nan")
        elif cell.values == "inf":
            t.view(-1)[0] = float("inf")
    return t


def _storage(master: torch.Tensor, kind: str, gen) -> tuple[torch.Tensor, Callable]:
    """(storage, view): view(storage) has master's values (expanded / broadcast: its first slice repeated) in
    `kind`'s layout."""
    shape = master.shape
    if kind == "contiguous":
        return master.clone(), lambda s: s
    if kind == "transposed":
        return master.transpose(-1, -2).contiguous(), lambda s: s.transpose(-1, -2)
    if kind == "expanded":
        return master[:1].clone(), lambda s: s.expand(shape)
    if kind == "broadcast":
        return master[..., :1].clone(), lambda s: s.expand(shape)

    def filler(shape_):
        if master.is_floating_point():
            return torch.randn(shape_, generator=gen, dtype=torch.float64)
        if master.numel() == 0:
            return torch.zeros(shape_, dtype=master.dtype)
        return master.reshape(-1)[:1].expand(shape_).clone()  # valid ids

    if kind == "strided":
        storage = filler(shape[:-1] + (2 * shape[-1],))
        storage[..., ::2] = master
        return storage, lambda s: s[..., ::2]
    if kind == "sliced":
        big = tuple(n + 1 for n in shape[:-1]) + (shape[-1] + 3,)
        storage = filler(big)
        index = tuple(slice(1, None) for _ in shape[:-1]) + (slice(1, 1 + shape[-1]),)
        storage[index] = master
        return storage, lambda s: s[index]
    raise ValueError(kind)


def _grad_set(cell: Cell, args: dict, dtypes: dict) -> set:
    floats = [n for n, a in args.items() if a.role in ("input", "param", "buffer") and dtypes[n].is_floating_point]
    if cell.grad == "all":
        return set(floats)
    if cell.grad == "default":
        return {n for n in floats if args[n].role != "buffer"}
    if cell.grad == "none":
        return set()
    role = "input" if cell.grad == "inputs" else "param"
    return {n for n in floats if args[n].role == role}


def _as_tuple(out):
    if out is None:
        return ()
    if isinstance(out, (torch.Tensor, Selection)):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(o for o in out if isinstance(o, (torch.Tensor, Selection)))
    if isinstance(out, (int, float)):
        return (torch.tensor(float(out), dtype=torch.float64),)
    raise TypeError(f"unexpected output {type(out).__name__}")


def _names_argument(message: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def _compare_selection(ids: torch.Tensor, expected: Selection, tol: float, what: str) -> Optional[str]:
    if ids.dtype not in (torch.int64, torch.int32):
        return f"{what}: ids of dtype {ids.dtype}"
    ids = ids.cpu().long()
    E = expected.probs.shape[-1]
    if ((ids < 0) | (ids >= E)).any() or (ids.sort(-1).values.diff(dim=-1) == 0).any():
        return f"{what}: ids out of range or repeated"
    p = expected.probs
    top = p.gather(-1, _select(p, expected.k))
    got = p.gather(-1, ids)
    if not torch.allclose(got, top, rtol=tol, atol=1e-12, equal_nan=True):
        return f"{what}: selected ids are not the top {expected.k} (torch.topk)"
    return None


def _compare(actual: torch.Tensor, expected, tol: float, what: str) -> Optional[str]:
    """None when `actual` matches the float64 `expected` (same NaN / inf positions), else what differs."""
    if actual.device.type == "meta":
        return f"{what}: a result on the meta device (mixed devices accepted)"
    if tuple(actual.shape) != tuple(expected.shape):
        return f"{what}: shape {tuple(actual.shape)}, torch gives {tuple(expected.shape)}"
    if isinstance(expected, Selection):
        return _compare_selection(actual, expected, tol, what)
    if not expected.is_floating_point():
        return None if torch.equal(actual.cpu().to(expected.dtype), expected) else f"{what}: ids differ from torch"
    a, e = actual.detach().cpu().double(), expected.detach().double()
    if not torch.equal(a.isnan(), e.isnan()):
        return f"{what}: NaN at {int((a.isnan() != e.isnan()).sum())} positions where torch differs"
    for sign in (1, -1):
        if not torch.equal(a == sign * float("inf"), e == sign * float("inf")):
            return f"{what}: inf positions differ from torch"
    finite = e.isfinite()
    if not finite.any():
        return None
    err = (a[finite] - e[finite]).abs()
    scale = e[finite].abs()
    # relative to each value and to the tensor's largest value, at least 0.1: a sum that cancels to ~0 in
    # float64 is held to the rounding of its O(1) terms
    bound = tol * (scale + max(scale.max().item(), 0.1))
    if (err > bound).any():
        i = int((err / bound).argmax())
        return f"{what}: |diff| {err[i].item():.3g} where torch gives {e[finite][i].item():.4g} (tol {tol:g})"
    return None


def is_base(cell: Cell) -> bool:
    """The target's base cell (plain supported input, eager): it must be correct."""
    return cell == Cell(cell.target, cell.path, **dict(TARGETS[cell.target].base))


def run_cell(cell: Cell, device: str = "cpu") -> Outcome:
    """Build the cell's inputs, run the target and its float64 oracle, and classify the outcome."""
    _register()
    start = time.perf_counter()
    target = TARGETS[cell.target]
    problem = target.problem
    args = problem.args(cell.shape)
    gen = torch.Generator().manual_seed(zlib.crc32(cell.id.replace(f"-{cell.path}-", "-").encode()))
    dtypes = {n: _arg_dtype(cell, n, a, problem.primary) for n, a in args.items()}
    needs_grad = _grad_set(cell, args, dtypes)
    layout_kind, layout_arg = cell.layout.split(":", 1) if ":" in cell.layout else ("contiguous", None)

    # the gradients compared: of the argument itself (the op's own result, before autograd sums it into an
    # expanded storage), or of the storage for an argument the op overwrites
    ours, ours_grad, ref, ref_grad, lowp = {}, {}, {}, {}, {}
    for name, arg in args.items():
        master = _master(cell, name, arg, dtypes[name], gen, problem)
        storage, view = _storage(master, layout_kind if name == layout_arg else "contiguous", gen)
        rg = name in needs_grad
        leaf = storage.to(device=device, dtype=dtypes[name], copy=True).requires_grad_(rg)
        ref_leaf = storage.clone().requires_grad_(rg)
        x, x64 = view(leaf.clone() if name in target.inplace else leaf), view(ref_leaf)
        if rg and name not in target.inplace:
            x.retain_grad()
            x64.retain_grad()
        ours_grad[name], ref_grad[name] = (leaf, ref_leaf) if name in target.inplace else (x, x64)
        ours[name] = x.to("meta") if cell.device == name else x
        ref[name] = x64
        lowp[name] = view(storage.to(device=device, dtype=dtypes[name]))  # for what runs in the inputs' dtype
    # the arguments an error message may name: with one bad axis value, those it touches (an integer main
    # input: that input; a layout: that argument; an id: the id argument); else any argument
    bad = [axis for axis, default in (("dtype", "fp32"), ("device", "same"), ("shape", "base"),
                                      ("layout", "contiguous"), ("values", "normal"), ("grad", "default"))
           if getattr(cell, axis) != default]
    culprits = set(args)
    if bad == ["dtype"] and cell.dtype == "int":
        culprits = {problem.primary}
    elif bad == ["layout"]:
        culprits = {layout_arg}
    elif bad == ["values"] and cell.values.startswith("id_"):
        culprits = {problem.index}
    names = set()
    for n in culprits:
        names |= {n, n.split("[")[0], *args[n].aliases}

    # the float64 oracle (its error means torch refuses the input too)
    try:
        expected = _as_tuple(problem.oracle(ref, lowp))
        oracle_error = None
    except (RuntimeError, ValueError, IndexError, TypeError) as e:  # torch refuses the input (else: a test bug)
        expected, oracle_error = (), e
    supported = (cell.dtype in target.dtypes and cell.shape in target.shapes and cell.grad in target.grads
                 and (target.layouts_ok or cell.layout == "contiguous"))
    must_error = oracle_error is not None or cell.device != "same" or cell.values in ("id_low", "id_high")

    def done(category, detail="", as_torch=False):
        return Outcome(cell, category, detail, time.perf_counter() - start, as_torch)

    if device == "cuda" and problem.index == "cu_seqlens" and isinstance(oracle_error, ValueError) \
            and str(oracle_error).startswith("cu_seqlens must"):
        # the ops check cu_seqlens' values on the device: the assert would poison this process's CUDA context
        # (the same check gives the CPU cells their ValueError; test_gpu_value_checks runs it in subprocesses)
        return done("clear_error", "cu_seqlens values: a device-side assert on CUDA (not run in this process)")

    with _path(cell.path):
        try:
            fn = target.build(args)
            if cell.mode != "eager":
                torch._dynamo.reset()
                fn = torch.compile(fn, backend="aot_eager" if cell.mode == "compile" else "eager", fullgraph=True)
            outputs = _as_tuple(fn(ours))
            error = None
        except Exception as e:  # noqa: BLE001
            outputs, error = (), e
        if error is not None:
            message = f"{type(error).__name__}: {error}"
            as_torch = (oracle_error is not None and type(error) is type(oracle_error)
                        and str(error) == str(oracle_error))  # torch's own error, as the HF code raises it
            if not as_torch and (not isinstance(error, CLEAR_ERRORS) or not _names_argument(str(error), names)):
                return done("unclear_error", message[:300])
            if not must_error and supported:
                return done("error_on_supported", message[:300])
            return done("clear_error", message[:160], as_torch)
        if must_error:
            why = f"torch raises {type(oracle_error).__name__}" if oracle_error is not None else "bad input accepted"
            return done("silent_wrong", f"returned a result; {why}")
        if len(outputs) != len(expected):
            return done("silent_wrong", f"{len(outputs)} outputs, torch gives {len(expected)}")
        tol = TOL[cell.dtype] * (4 if cell.shape == "big" else 1)
        for i, (o, e) in enumerate(zip(outputs, expected)):
            problem_ = _compare(o, e, tol, f"output {i}")
            if problem_:
                return done("silent_wrong", problem_)
        if needs_grad:
            g_gen = torch.Generator().manual_seed(1)
            pairs = [(o, e) for o, e in zip(outputs, expected) if e.is_floating_point() and e.requires_grad]
            for o, e in pairs:
                if not o.requires_grad:
                    return done("silent_wrong", "an output that torch differentiates carries no gradient")
            gs = [torch.randn(e.shape, generator=g_gen, dtype=torch.float64) for _, e in pairs]
            try:
                if pairs:
                    sum((o.double() * g.to(o.device)).sum() for (o, _), g in zip(pairs, gs)).backward()
            except Exception as e:  # noqa: BLE001
                message = f"backward: {type(e).__name__}: {e}"
                if not isinstance(e, CLEAR_ERRORS) or not _names_argument(str(e), names):
                    return done("unclear_error", message[:300])
                return done("error_on_supported" if supported else "clear_error", message[:300])
            if pairs:
                sum((e * g).sum() for (_, e), g in zip(pairs, gs)).backward()
            for n in needs_grad:
                got, want = ours_grad[n].grad, ref_grad[n].grad
                if want is None or not want.abs().gt(0).any():
                    if got is not None and got.abs().gt(0).any():
                        return done("silent_wrong", f"d{n}: a gradient where torch has none")
                    continue
                if got is None:
                    return done("silent_wrong", f"d{n}: no gradient (torch has one)")
                problem_ = _compare(got, want, tol * 2, f"d{n}")
                if problem_:
                    return done("silent_wrong", problem_)
        return done("correct")


# ----------------------------------------------------------------------------------------------- report

CATEGORIES = ("correct", "clear_error", "silent_wrong", "unclear_error", "error_on_supported")


def _axis_label(cell: Cell, axis: str) -> str:
    value = getattr(cell, axis)
    if axis == "device":
        return "same" if value == "same" else "one argument elsewhere"
    return value.split(":")[0] if axis == "layout" else value


def report(outcomes: list[Outcome], seconds: Optional[float] = None) -> str:
    """The matrix report as markdown: totals, per target, and every failing cell."""
    _register()
    by_target: dict[str, dict] = {}
    for o in outcomes:
        row = by_target.setdefault(o.cell.target, dict.fromkeys(CATEGORIES, 0))
        row[o.category] += 1
    totals = {c: sum(r[c] for r in by_target.values()) for c in CATEGORIES}
    paths = sorted({o.cell.path for o in outcomes})
    lines = [
        "# Bad-input matrix",
        "",
        "Every public op, Layer and Layout of the kernel repos on bad inputs, against float64 torch.",
        "Generated by `tests/bad_input_matrix.py`; regenerate with",
        "`HUBFUSE_BAD_INPUT_REPORT=docs/bad_input_matrix.md python -m pytest tests/test_bad_input_matrix.py`.",
        "",
        f"Paths: {', '.join(paths)} (ref: torch path, interp: Triton kernels under the interpreter). "
        f"Modes: eager, torch.compile (aot_eager / eager backend, fullgraph).",
        "",
        f"**{len(outcomes)} cells: {totals['correct']} correct, {totals['clear_error']} clear errors, "
        f"{totals['silent_wrong']} silent wrong, {totals['unclear_error']} unclear errors, "
        f"{totals['error_on_supported']} errors on supported input.**"
        + (f" Run time {seconds:.0f} s (sum over the cells)." if seconds is not None
           else ""),
        "",
        f"Of the clear errors, {sum(o.as_torch for o in outcomes)} are torch's own, word for word (the float64 "
        "oracle raises the same: HF's code in the Layouts, torch's checks); every other names the argument at "
        "fault. Kinds: " + ", ".join(f"{sum(TARGETS[o.cell.target].kind == k for o in outcomes)} cells of "
                                     f"{len({t for t in by_target if TARGETS[t].kind == k})} {k}s"
                                     for k in ("op", "layer", "layout")) + ".",
        "",
        "Cells per axis value (a cell has one or two non-default values; the rest are the defaults fp32, same "
        "device, base shape, contiguous, normal values, default grads, eager):",
        "",
        "| axis | cells per value |",
        "| --- | --- |",
        *[f"| {axis} | " + ", ".join(f"{v} {n}" for v, n in sorted(
            collections.Counter(_axis_label(o.cell, axis) for o in outcomes).items())) + " |"
          for axis in ("path", "mode", "dtype", "device", "shape", "layout", "values", "grad")],
        "",
        "| target | kind | cells | correct | clear errors | silent wrong | unclear errors | errors on supported |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in by_target.items():
        t = TARGETS[name]
        lines.append(f"| `{name}` | {t.kind} | {sum(row.values())} | {row['correct']} | {row['clear_error']} | "
                     f"{row['silent_wrong']} | {row['unclear_error']} | {row['error_on_supported']} |")
    notes = [f"- `{t.name}`: {t.note}" for t in TARGETS.values() if t.note]
    if notes:
        lines += ["", "Target notes:", *notes]
    lines += ["", "Public names outside the matrix:", *[f"- `{k}`: {v}" for k, v in EXCLUDED.items()]]
    failures = [o for o in outcomes if o.category not in ("correct", "clear_error")]
    if failures:
        lines += ["", "Failing cells:", *[f"- `{o.cell.id}` {o.category}: {o.detail}" for o in failures]]
    return "\n".join(lines) + "\n"


RESULTS: list[Outcome] = []
