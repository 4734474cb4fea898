#!/usr/bin/env python
"""Training-step benchmark on model slices: HF eager, torch.compile (default and reduce-overhead), Liger
(+ compile), and hubfuse in every mode a user runs (eager, + compile, + reduce-overhead, whole-step CUDA graph).

One training step = forward + backward + fused AdamW step, bf16 weights (and bf16 AdamW states), random tokens
with labels = input_ids, the same weights and batches for every configuration of a slice.

Slices (decoder layers, batch x tokens per sequence; the full vocabulary):
  qwen3_0_6b         the published Qwen3-0.6B config: 28 layers, hidden 1024, intermediate 3072, 16/8 heads,
                     head_dim 128, vocab 151936, tied embeddings; 8 x 1024
  qwen3_small        Qwen3-0.6B widths, 8 layers, vocab 32000; 8 x 1024
  qwen3_moe_small    8 layers, hidden 1024, 32 experts top-4, moe_intermediate 768, 16/8 heads, head_dim 128,
                     vocab 32000, router aux loss on; 8 x 1024
  qwen3_30b_a3b_8l   Qwen3-30B-A3B widths, 8 layers; 8 x 1024
  qwen3_8b           Qwen3-8B-like: hidden 4096, intermediate 12288, 32/8 heads, head_dim 128; 4 layers, 8 x 2048
  qwen3_30b_a3b      Qwen3-30B-A3B-like: hidden 2048, 128 experts top-8, moe_intermediate 768, 32/4 heads,
                     head_dim 128, router aux loss on; 4 layers, 8 x 2048
  qwen3_5_moe        Qwen3.5-MoE-like: the defaults of transformers' Qwen3_5MoeTextConfig (hidden 2048, 256
                     experts top-8, moe_intermediate 512, shared expert 512, 16/2 heads, head_dim 256, partial RoPE
                     0.25, gated attention, vocab 248320), layer_types 3 x linear_attention + 1 x full_attention,
                     router aux loss on; 4 layers, 8 x 2048
  qwen3_5_moe_medium the same with 64 experts and vocab 32000; 4 layers, 8 x 1024 (issue 32's step slice)
Configurations:
  eager          HF eager (sdpa attention; MoE experts with experts_implementation="grouped_mm")
  compile        the same + torch.compile of the whole model (fwd+bwd; the optimizer step stays eager)
  compile_ro     the same with mode="reduce-overhead" (CUDA graphs of the compiled graphs)
  liger          the same as eager + liger_kernel's apply_liger_kernel_to_qwen3 / _qwen3_moe / _qwen3_5_moe
                 (patched before the load)
  liger_compile  liger + torch.compile
  fla            Gated DeltaNet models: HF eager with flash-linear-attention installed (transformers then runs
                 FLA's chunk_gated_delta_rule); FLA comes from its own site dir ($HUBFUSE_FLA_SITE, kept out of the
                 common one) and its Hopper guard (gated backward refused on Triton >= 3.4, < 3.7.1, FLA issue
                 #640) is bypassed: a timing anchor for a user on a newer Triton, where the guard is lifted
  liger_fla      fla + Liger
  ours           hubfuse.KernelConfig(presets.kernel_mapping(family, revision="v1")) + presets.enable_losses
                 (local builds through LOCAL_KERNELS, as tests/utils.py)
  ours_modules   ours with per-module kernels in the dense decoder layers (`kernel_mapping(...,
                 decoder_layer=False)`: the attention Layout and the RMSNorm + MLP fusion, no decoder-layer node)
  ours_compile   ours + torch.compile of the whole kernelized model
  ours_ro        ours + torch.compile(mode="reduce-overhead")
  ours_graph     ours, the whole step (fwd + bwd + capturable fused AdamW) captured once in a torch.cuda.CUDAGraph
                 and replayed (the batch copied into the graph's static inputs)
  <config>+adamw any of the above with hubfuse.optim.AdamW (same arguments) in place of torch's fused AdamW
  <config>@<b>   any of the above with SDPA restricted to one backend b (flash, cudnn, efficient, math) through
                 torch.nn.attention.sdpa_kernel, for the whole run (capture included); `--sdpa-backends b ...`
                 runs every --configs entry once per backend
The HF configurations pass use_cache=False; ours leave it at its default (a hubfuse-loaded model in training mode
builds no KV cache unless asked).

Every (slice, config) runs in its own subprocess (Liger patches classes globally; a crash, OOM or timeout
loses one row, not the run). The first subprocess of a slice builds the model from its config (random init,
on the device) and saves it to a temp dir; every configuration loads it with from_pretrained (our kernels
need the load path). When the time budget (--budget-s) runs out, the rows not run say so.

Reported per row: step ms (median over --steps steps after --warmup, each step synchronised), tokens/s, host ms
(median time to enqueue one step with the GPU queue drained: the CPU's share), GPU ms (summed kernel time per
step, torch.profiler), kernels and launch calls per step (profiler: kernels run; CUDA launch API calls made by
the host, a graph replay counting once), peak memory (max_memory_allocated over the measured steps; CPU: max RSS),
the loss of step 1 and of the last step (MoE: includes router_aux_loss_coef * aux loss); compiled rows also what
dynamo did (graphs, graph breaks and recompiles with their first reasons, CUDA-graph partitions skipped by inductor).
Each ours / ours_graph pair of a slice (same backend) gets a per-kernel table: the profiler's top kernels, ms and
calls per step, eager next to graph replay.
Writes $OUT/bench_train.json, $OUT/bench_train.md and $OUT/bench_train_{speed,memory}.png (OUT defaults to
./out), after every run (partial results survive a kill).

    python scripts/bench.py --slices qwen3_small qwen3_moe_small   # every configuration on two slices
    python scripts/bench.py --slices qwen3_0_6b --configs eager compile compile_ro ours ours_graph
    python scripts/bench.py --configs compile --append              # add rows to an existing bench_train.json
    python scripts/bench.py --slices qwen3_0_6b --configs ours ours_graph --sdpa-backends flash cudnn efficient
    python scripts/bench.py --report-only --out DIR                 # the compact table of DIR/bench_train.json
    python scripts/bench.py --smoke                                 # CPU, tiny dims, eager + ours, < 90 s
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "torch-ext"))  # hubfuse without `pip install -e .`

REVISION = "v1"
# also the run order: eager first, compiled last (slowest to start)
CONFIGS = ("eager", "ours", "ours_modules", "ours_graph", "compile", "compile_ro", "liger", "fla", "liger_fla",
           "ours_ro", "ours_compile", "liger_compile")
OURS = ("ours", "ours_modules", "ours_compile", "ours_ro", "ours_graph")
LIGER = ("liger", "liger_compile", "liger_fla")
FLA = ("fla", "liger_fla")  # Gated DeltaNet models: transformers runs flash-linear-attention's kernels when installed
COMPILED = ("compile", "compile_ro", "liger_compile", "ours_compile", "ours_ro")
REDUCE_OVERHEAD = ("compile_ro", "ours_ro")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe_text")
# `<config>@<backend>`: the configuration with SDPA restricted to one backend (torch.nn.attention.sdpa_kernel) for
# the whole run, the CUDA-graph capture included
# `<config>+adamw`: the configuration with hubfuse.optim.AdamW as its optimizer (the same arguments)
ADAMW_SUFFIX = "+adamw"
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
LIGER_APPLY = {"qwen3": "apply_liger_kernel_to_qwen3", "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
               "qwen3_5_moe_text": "apply_liger_kernel_to_qwen3_5_moe"}
COMMON = dict(vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=40960,
              attention_bias=False)
QWEN3_0_6B = dict(COMMON, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, tie_word_embeddings=True, rope_theta=1000000.0)
QWEN3_30B_A3B = dict(COMMON, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=True,
                     router_aux_loss_coef=0.001)
SLICES = {
    "qwen3_0_6b": dict(family="qwen3", title="Qwen3-0.6B", layers=28, batch=8, seq=1024, config=QWEN3_0_6B),
    "qwen3_small": dict(family="qwen3", title="Qwen3 small", layers=8, batch=8, seq=1024,
                        config=dict(QWEN3_0_6B, vocab_size=32000, tie_word_embeddings=False)),
    "qwen3_moe_small": dict(family="qwen3_moe", title="Qwen3-MoE small", layers=8, batch=8, seq=1024, config=dict(
        QWEN3_30B_A3B, vocab_size=32000, hidden_size=1024, num_experts=32, num_experts_per_tok=4,
        num_attention_heads=16, num_key_value_heads=8)),
    "qwen3_30b_a3b_8l": dict(family="qwen3_moe", title="Qwen3-30B-A3B widths, 8 layers", layers=8, batch=8,
                             seq=1024, config=QWEN3_30B_A3B),
    "qwen3_8b": dict(family="qwen3", title="Qwen3-8B-like", layers=4, batch=8, seq=2048, config=dict(
        COMMON, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128)),
    "qwen3_30b_a3b": dict(family="qwen3_moe", title="Qwen3-30B-A3B-like", layers=4, batch=8, seq=2048,
                          config=QWEN3_30B_A3B),
    # Qwen3_5MoeTextConfig defaults; only the layer count (and layer_types to match it) and the aux loss change
    "qwen3_5_moe": dict(family="qwen3_5_moe_text", title="Qwen3.5-MoE-like", layers=4, batch=8, seq=2048,
                        config=dict(output_router_logits=True)),
    "qwen3_5_moe_medium": dict(family="qwen3_5_moe_text", title="Qwen3.5-MoE medium", layers=4, batch=8, seq=1024,
                               config=dict(output_router_logits=True, num_experts=64, vocab_size=32000)),
}
# --smoke: tiny dims of the same structure (CPU, bf16)
_SMOKE_DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)
_SMOKE_MOE = dict(_SMOKE_DENSE, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
_SMOKE_QWEN3_5 = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4)
SMOKE_DIMS = {
    "qwen3_0_6b": _SMOKE_DENSE, "qwen3_small": _SMOKE_DENSE, "qwen3_8b": _SMOKE_DENSE,
    "qwen3_moe_small": _SMOKE_MOE, "qwen3_30b_a3b_8l": _SMOKE_MOE, "qwen3_30b_a3b": _SMOKE_MOE,
    "qwen3_5_moe": _SMOKE_QWEN3_5, "qwen3_5_moe_medium": _SMOKE_QWEN3_5,
}
SMOKE_SLICES = ("qwen3_small", "qwen3_moe_small", "qwen3_5_moe")  # one per family: the CPU check
# Per-run timeouts (s): subprocess start, load, compile / autotuning, the steps. Liger's fused MoE autotunes for
# ~3.5 min on its first call (235 s for the Qwen3-30B-A3B slice on an H200).
TIMEOUT_S = {"eager": 150, "ours": 180, "ours_modules": 180, "ours_graph": 180, "liger": 300, "compile": 300,
             "compile_ro": 360,
             "ours_compile": 300, "ours_ro": 360, "liger_compile": 360, "fla": 300, "liger_fla": 360}


def log(msg: str) -> None:
    print(msg, flush=True)


def split_config(config: str) -> tuple[str, str | None]:
    """("ours_graph", "cudnn") for "ours_graph@cudnn" (and for "ours_graph+adamw@cudnn"); (config, None) without a
    backend."""
    base, _, backend = config.partition("@")
    return base.removesuffix(ADAMW_SUFFIX), backend or None


def uses_hubfuse_adamw(config: str) -> bool:
    """`<config>+adamw`: the step's optimizer is hubfuse.optim.AdamW instead of torch's fused AdamW."""
    return config.partition("@")[0].endswith(ADAMW_SUFFIX)


def config_key(config: str) -> tuple[int, bool, str]:
    """Sort key: the run order of CONFIGS, then +adamw, then the backend."""
    base, backend = split_config(config)
    return CONFIGS.index(base), uses_hubfuse_adamw(config), backend or ""


def parse_config(text: str) -> str:
    """argparse type of --configs: a name of CONFIGS, optionally `+adamw`, optionally `@<SDPA backend>`."""
    base, backend = split_config(text)
    if base not in CONFIGS or (backend is not None and backend not in SDPA_BACKENDS):
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {list(CONFIGS)}, optionally followed by "
                                         f"{ADAMW_SUFFIX} and by @<backend> with backend in {list(SDPA_BACKENDS)}")
    return text


def layer_types(n: int) -> list[str]:
    """Qwen3.5's pattern (every 4th layer full attention), with at least one full-attention layer."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    if n > 1 and "linear_attention" not in types:
        types[0] = "linear_attention"
    return types


def slice_config(name: str, layers: int, smoke: bool):
    from transformers import AutoConfig

    spec = SLICES[name]
    kw = dict(spec["config"], num_hidden_layers=layers)
    if smoke:
        kw.update(SMOKE_DIMS[name])
    if spec["family"] == "qwen3_5_moe_text":
        kw["layer_types"] = layer_types(layers)
    return AutoConfig.for_model(spec["family"], **kw)


def shape_of(name: str, args) -> tuple[int, int, int]:
    """(layers, batch, seq) of a slice: the command line's where given, else the slice's own (smoke: tiny)."""
    if args.smoke:
        default = (2, 2, 32)
    else:
        default = (SLICES[name]["layers"], SLICES[name]["batch"], SLICES[name]["seq"])
    given = (args.layers, args.batch, args.seq)
    return tuple(g if g is not None else d for g, d in zip(given, default))


# ----------------------------------------------------------------------------------------------- child process
def liger_modules(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, module in model.named_modules():
        if type(module).__name__.startswith("Liger"):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    fwd = getattr(type(model).forward, "__module__", "") or ""
    if "liger" in fwd:
        counts["forward->" + fwd] = 1
    return counts


ROUTED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # parameter names of the routed experts (MoE)


def is_routed_expert(name: str) -> bool:
    return name.endswith(ROUTED_EXPERTS)


def ensure_model(name: str, path: Path, args, device: str, routed_experts: bool = True) -> None:
    """Build the slice's model from its config (random init, bf16, on the device) and save it, once.
    routed_experts=False: the checkpoint leaves the routed experts out (built on the meta device, never
    materialized): at Qwen3-30B-A3B widths, 48 layers, they are 95 % of the bytes. Whoever loads it initializes
    them (`init_routed_experts`); every other parameter is saved as transformers initialized it."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = slice_config(name, shape_of(name, args)[0], args.smoke)
    fingerprint = cfg.to_json_string(use_diff=False)
    done = path / "DONE"
    built = json.loads(done.read_text()) if done.exists() else {}
    if built.get("config") == fingerprint and built.get("routed_experts", True) == routed_experts:
        return  # built by an earlier run (same config), e.g. a kept --model-dir
    t0 = time.time()
    torch.manual_seed(0)
    if routed_experts:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        experts = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if is_routed_expert(n)}
        for module_name, module in model.named_modules():
            if module_name not in experts:
                module.to_empty(device=device, recurse=False)
        model.initialize_weights()  # transformers' own init of what is materialized (a no-op on the meta experts)
    state = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    n = sum(v.numel() for v in state.values())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=state, max_shard_size="100GB")
    done.write_text(json.dumps(dict(params=n, config=fingerprint, routed_experts=routed_experts)))
    del model, state
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"  built {name}: {n / 1e9:.3f} B parameters{'' if routed_experts else ' (routed experts left out)'}, "
        f"saved in {time.time() - t0:.1f} s")


def init_routed_experts(model, std: float) -> None:
    """Initialize the routed experts that a `routed_experts=False` checkpoint left out, as transformers does
    (normal, mean 0, `std` = config.initializer_range), in place, on the device they are on. Each local shard
    (DTensor: its position along the Shard dims of its mesh) draws from its own seed, derived from the parameter
    name and that position: the same values for every configuration sharded the same way, replicas equal.
    (transformers' own init of missing weights skips kernel Layout classes such as the hubfuse experts.)"""
    import zlib

    import torch
    from torch.distributed.tensor import DTensor, Shard

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not is_routed_expert(name):
                continue
            local, where = p, ()
            if isinstance(p, DTensor):
                local = p.to_local()
                where = tuple(c if isinstance(pl, Shard) else 0
                              for c, pl in zip(p.device_mesh.get_coordinate(), p.placements))
            g = torch.Generator(device=local.device).manual_seed(zlib.crc32(f"{name}{where}".encode()))
            local.normal_(0.0, std, generator=g)


def enable_fla() -> None:
    """Put flash-linear-attention ($HUBFUSE_FLA_SITE) on sys.path, with the Hopper guard of its gated backward
    bypassed (the guard's condition only; the kernels are unchanged), as scripts/bench_cases/gated_delta_net.py."""
    sys.path.insert(0, os.environ["HUBFUSE_FLA_SITE"])
    import fla.ops.common.chunk_o as chunk_o

    chunk_o.TRITON_ABOVE_3_7_1 = True


def load_model(name: str, config: str, path: Path, device: str):
    import torch

    from tests.utils import load

    family = SLICES[name]["family"]
    kw = dict(attn_implementation="sdpa")
    if family in MOE_FAMILIES:
        kw["experts_implementation"] = "grouped_mm"
    note = ""
    if config in LIGER:
        import liger_kernel.transformers as lt

        getattr(lt, LIGER_APPLY[family])()  # class-level patches, before the modules are built
    if config in OURS:
        from hubfuse import presets

        mapping = presets.kernel_mapping(family, revision=REVISION, decoder_layer=config != "ours_modules")
        model = load(path, mapping, dtype=torch.bfloat16, device=device, **kw)
        presets.enable_losses(model, family, revision=REVISION)
        extra = presets.bound_kernels(model)
    else:
        model = load(path, dtype=torch.bfloat16, device=device, **kw)
        extra = liger_modules(model) if config in LIGER else {}
    model.train()
    return model, extra, note


def make_step(model, config: str, device: str, first_batch: dict, hubfuse_adamw: bool = False):
    """The training step of one configuration: step(batch) -> loss tensor (no host sync inside), and the optimizer.

    ours_graph: `hubfuse.cuda_graphs.capture_train_step` (warm-up on a side stream, then fwd + bwd + the
    capturable fused AdamW step in one CUDA graph; a step copies the batch in and replays it).
    The HF configurations pass `use_cache=False` (else transformers fills a KV cache nothing reads); ours leave it
    at its default, which a hubfuse-loaded model in training mode takes as False (`hubfuse.training`)."""
    import torch

    cuda = device == "cuda"
    graph = config == "ours_graph"
    if hubfuse_adamw:
        from hubfuse.optim import AdamW

        opt = AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda, capturable=graph)
    run = model
    if config in COMPILED:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        run = torch.compile(model, mode="reduce-overhead" if config in REDUCE_OVERHEAD else None)

    cache = {} if config in OURS else {"use_cache": False}

    def eager_step(batch):
        if config in REDUCE_OVERHEAD:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = run(**batch, **cache).loss
        loss.backward()
        opt.step()
        return loss

    if not graph:
        return eager_step, opt
    from hubfuse.cuda_graphs import capture_train_step

    return capture_train_step(model, opt, first_batch), opt


def dynamo_stats() -> dict:
    """What torch.compile did in this process: graphs, graph breaks (and why), recompiles (and the failed guards),
    CUDA-graph partitions inductor skipped (reduce-overhead)."""
    from torch._dynamo.utils import counters, guard_failures

    breaks = counters["graph_break"]
    failures = [reason for reasons in guard_failures.values() for reason in reasons]
    return dict(graphs=counters["stats"].get("unique_graphs", 0), graph_breaks=sum(breaks.values()),
                break_reasons=[r.splitlines()[0][:160] for r in list(breaks)[:3]],
                recompiles=len(failures), recompile_reasons=[str(r)[:160] for r in failures[:3]],
                cudagraph_skips=counters["inductor"].get("cudagraph_skips", 0))


def dynamo_note(stats: dict) -> str:
    text = (f"dynamo: {stats['graphs']} graph(s), {stats['graph_breaks']} break(s), {stats['recompiles']} "
            f"recompile(s), {stats['cudagraph_skips']} cudagraph skip(s)")
    reasons = stats["break_reasons"] + stats["recompile_reasons"]
    return text + (f" ({'; '.join(reasons)})" if reasons else "")


def profile_step(step, batches, device: str) -> dict:
    """GPU ms, kernels and host launch calls per step, from torch.profiler over a few steps."""
    from torch.profiler import ProfilerActivity, profile

    import torch

    launch_apis = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                   "cudaGraphLaunch", "cudaMemsetAsync", "cudaMemcpyAsync", "cudaLaunchCooperativeKernel")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            step(batch)
        torch.cuda.synchronize()
    gpu_us = kernels = launches = 0
    by_kernel: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            us = e.time_range.elapsed_us()
            gpu_us += us
            kernels += 1
            entry = by_kernel.setdefault(e.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += us
        elif e.name in launch_apis:
            launches += 1
    n = len(batches)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:40]
    return dict(gpu_ms=round(gpu_us / n / 1e3, 2), kernels_per_step=round(kernels / n, 1),
                launches_per_step=round(launches / n, 1),
                top_kernels=[(name, round(c / n, 1), round(us / n / 1e3, 3)) for name, (c, us) in top])


def cprofile_step(step, batch, top: int) -> str:
    """cProfile of one step (the host's Python), the `top` functions by own and by cumulative time, then the
    torch profiler's `top` ops of another step by self CPU time."""
    import cProfile
    import io
    import pstats

    import torch

    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    step(batch)
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(top)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(batch)
        torch.cuda.synchronize()
    buf.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return buf.getvalue()


def child(args) -> int:
    """Runs args.child_configs of one slice (one per process on the GPU; --smoke groups a slice's configs)."""
    import resource
    import statistics

    import torch

    name = args.slices[0]
    device = "cpu" if args.smoke else "cuda"
    cuda = device == "cuda"
    out = Path(args.child_out)
    path = Path(args.model_dir) / name
    results = []

    def save():
        out.write_text(json.dumps(results, indent=1))

    if any(split_config(c)[0] in FLA for c in args.child_configs):
        enable_fla()  # before transformers imports the modeling module (it picks FLA's kernels at import)
    try:
        ensure_model(name, path, args, device)
    except Exception as e:
        for config in args.child_configs:
            results.append(dict(slice=name, config=config, status="error", note=f"build: {type(e).__name__}: {e}"[:500]))
        save()
        raise
    layers, batch_size, seq = shape_of(name, args)
    cfg = slice_config(name, layers, args.smoke)
    g = torch.Generator().manual_seed(1234)
    n_host, n_prof = (args.host_steps, args.profile_steps) if cuda else (0, 0)
    batches = []
    for _ in range(args.warmup + args.steps + n_host + n_prof):
        ids = torch.randint(0, cfg.vocab_size, (batch_size, seq), generator=g).to(device)
        batches.append({"input_ids": ids, "labels": ids})
    tokens = batch_size * seq
    for config in args.child_configs:
        base, backend = split_config(config)
        tag = f"[{name}/{config}]"
        row = dict(slice=name, config=config, device=device, tokens_per_step=tokens, layers=layers,
                   sdpa_backend=backend)
        results.append(row)
        t_start = time.time()
        model = opt = step = None
        scope = contextlib.ExitStack()  # the SDPA backend restriction, for the whole run of this config
        try:
            if backend is not None:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                scope.enter_context(sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])))
            log(f"{tag} loading (from_pretrained, bf16, {device})")
            model, extra, note = load_model(name, base, path, device)
            row["modules"] = extra
            if base in OURS:
                log(f"{tag} kernels bound: {extra}")
                if not extra:
                    raise RuntimeError("no hubfuse kernel bound to the model")
            elif extra:
                log(f"{tag} liger modules: {extra}")
            if cuda:
                torch.cuda.synchronize()
                row["after_load_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
            step, opt = make_step(model, base, device, batches[0], uses_hubfuse_adamw(config))
            row["load_s"] = round(time.time() - t_start, 1)
            times, losses = [], []
            for i, batch in enumerate(batches[:args.warmup + args.steps]):
                if i == args.warmup and cuda:
                    row["peak_warmup_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    row["peak_warmup_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
                    row["peak_warmup_requested_MiB"] = round(
                        torch.cuda.memory_stats().get("requested_bytes.all.peak", float("nan")) / 2**20, 1)
                    if base != "ours_graph":  # the graph's memory pool was allocated by the capture
                        torch.cuda.reset_peak_memory_stats()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = step(batch)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                losses.append(loss.item())
                if i >= args.warmup:
                    times.append(dt)
                if i < args.warmup or (i - args.warmup) % 5 == 4 or i == args.warmup + args.steps - 1:
                    phase = "warm-up" if i < args.warmup else "step"
                    log(f"{tag} {phase} {i + 1}/{args.warmup + args.steps}: {dt * 1e3:.1f} ms, loss {losses[-1]:.4f}")
            med = statistics.median(times)
            row.update(status="ok", tokens_per_s=round(tokens / med, 1), step_ms_median=round(med * 1e3, 2),
                       step_ms_min=round(min(times) * 1e3, 2), step_ms_max=round(max(times) * 1e3, 2),
                       loss_step1=losses[0], loss_last=losses[-1], steps=len(times), warmup=args.warmup)
            if cuda:
                row["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                row["peak_mem_MiB"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
                # the bytes asked for (the allocated figure counts whole cached blocks a request was given)
                row["peak_requested_MiB"] = round(
                    torch.cuda.memory_stats().get("requested_bytes.all.peak", float("nan")) / 2**20, 1)
                row["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
                rest = batches[args.warmup + args.steps:]
                host = []
                for batch in rest[:n_host]:  # enqueue time with the GPU queue drained
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(batch)
                    host.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                if host:
                    row["host_ms"] = round(statistics.median(host) * 1e3, 2)
                if n_prof:
                    row.update(profile_step(step, rest[n_host:], device))
                if args.cprofile and config in args.cprofile:
                    out_dir = Path(os.environ.get("OUT") or ROOT / "out")
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / f"cprofile_{name}_{config}.txt").write_text(cprofile_step(step, rest[0], 60))
                    log(f"{tag} cProfile of one step: {out_dir / f'cprofile_{name}_{config}.txt'}")
            else:
                row["peak_mem_GiB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
                row["note"] = (note + " " if note else "") + "CPU: peak = max RSS of the process"
            if base in COMPILED:
                row["dynamo"] = dynamo_stats()
                row["note"] = dynamo_note(row["dynamo"])
                log(f"{tag} {row['note']}")
            if not all(math.isfinite(v) for v in losses):
                row["status"] = "error"
                row["note"] = f"non-finite loss: {losses}"
            log(f"{tag} {row['status']}: {row['tokens_per_s']:.0f} tokens/s, median step {row['step_ms_median']:.1f} ms"
                + (f", host {row['host_ms']:.1f} ms, GPU {row['gpu_ms']:.1f} ms, {row['launches_per_step']:.0f} launch "
                   f"calls/step" if "gpu_ms" in row else "")
                + f", peak {row['peak_mem_GiB']} GiB"
                + (f" ({row['peak_mem_MiB']} MiB; warm-up {row.get('peak_warmup_MiB')} MiB)" if "peak_mem_MiB" in row
                   else "") + f", loss step 1 {row['loss_step1']:.4f}")
        except Exception as e:  # record and go on (an OOM too)
            oom = "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"
            row.update(status="oom" if oom else "error", note=f"{type(e).__name__}: {str(e)[:400]}")
            if cuda:
                row["peak_mem_GiB_at_failure"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            log(f"{tag} {row['status']}: {row['note']}")
            import traceback

            traceback.print_exc()
        scope.close()
        row["wall_s"] = round(time.time() - t_start, 1)
        save()
        del model, opt, step
        if cuda:
            torch.cuda.empty_cache()
    save()
    return 0


# ---------------------------------------------------------------------------------------------- parent process
def run_child(cmd, timeout: float, tag: str, env) -> tuple[int | None, list[str]]:
    """Run a child in its own process group, echo its output, kill the whole group on timeout."""
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True, bufsize=1)

    def pump():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if line.startswith("[") or line.startswith("  built") or "Error" in line or "error" in line[:40]:
                log("  " + line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its compile workers
        except ProcessLookupError:
            pass
        proc.wait()
        rc = None
        log(f"  {tag} TIMEOUT after {timeout:.0f} s (killed)")
    reader.join(timeout=5)
    return rc, list(tail)


def host_yardstick_us() -> float:
    """The host's Python speed: us a `sum(range(1000))`, the best of five runs of 1000. A rough guide to the host an
    eager (host-bound) step ran on: the lent machines' hosts differ by ~2x in it, though it does not predict such a
    step alone (docs/benchmarks.md, dense step)."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            sum(range(1000))
        runs.append(time.perf_counter() - t0)
    return round(min(runs) * 1e3, 2)


def env_meta(smoke: bool) -> dict:
    import importlib.metadata as md

    import torch

    meta = dict(torch=torch.__version__, python=sys.version.split()[0])
    for dist in ("transformers", "kernels", "liger-kernel", "triton", "flash-linear-attention", "causal-conv1d",
                 "accelerate"):
        try:
            meta[dist] = md.version(dist)
        except md.PackageNotFoundError:
            meta[dist] = None
    meta["device"] = "cpu (smoke)" if smoke else (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    meta["host_yardstick_us"] = host_yardstick_us()
    return meta


def fmt(v, spec):
    return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def compact_table(rows) -> list[str]:
    """The per-row numbers the issue's targets are stated in: step, host and GPU ms, launches, peak memory."""
    lines = ["| slice | config | status | step ms | host ms | GPU ms | launches | peak GiB | note |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['slice']} | {r['config']} | {r.get('status')} | {fmt(r.get('step_ms_median'), '.1f')} | "
                     f"{fmt(r.get('host_ms'), '.1f')} | {fmt(r.get('gpu_ms'), '.1f')} | "
                     f"{fmt(r.get('launches_per_step'), '.0f')} | {fmt(r.get('peak_mem_GiB'), '.2f')} | "
                     f"{(r.get('note') or '')[:90].replace('|', '/')} |")
    return lines


def summary(rows) -> list[str]:
    """Per slice: hubfuse's best mode against the best peer, plain hubfuse against HF + compile, hubfuse's other
    modes against plain hubfuse (step and peak memory), and peak memory against HF + compile."""
    by = {(r["slice"], r["config"]): r for r in rows}
    lines = []
    for s in dict.fromkeys(r["slice"] for r in rows):
        ok = {c: by[(s, c)] for c in CONFIGS if by.get((s, c), {}).get("status") == "ok"}
        peers = {c: r for c, r in ok.items() if c not in OURS}
        ours = {c: r for c, r in ok.items() if c in OURS}
        if not (peers and ours):
            continue
        best_peer = min(peers, key=lambda c: peers[c]["step_ms_median"])
        best_ours = min(ours, key=lambda c: ours[c]["step_ms_median"])
        line = (f"- {s}: best hubfuse mode {best_ours} {ours[best_ours]['step_ms_median']:.1f} ms vs best peer "
                f"{best_peer} {peers[best_peer]['step_ms_median']:.1f} ms: "
                f"{peers[best_peer]['step_ms_median'] / ours[best_ours]['step_ms_median']:.2f}x")
        if "ours" in ours and "compile" in peers:
            line += (f"; plain hubfuse vs HF + compile "
                     f"{peers['compile']['step_ms_median'] / ours['ours']['step_ms_median']:.2f}x")
            if ours["ours"].get("host_ms") and ours["ours"].get("gpu_ms"):
                line += f" (host / GPU {ours['ours']['host_ms'] / ours['ours']['gpu_ms']:.2f})"
        if "ours" in ours:
            for mode in ("ours_graph", "ours_compile", "ours_ro"):
                if mode in ours:
                    line += (f"; {mode} vs ours: {ours['ours']['step_ms_median'] / ours[mode]['step_ms_median']:.2f}x"
                             f" speed, {ours[mode]['peak_mem_GiB'] / ours['ours']['peak_mem_GiB']:.2f}x peak")
        if "compile" in peers and peers["compile"].get("peak_mem_GiB"):
            line += (f"; peak of {best_ours} / HF + compile "
                     f"{ours[best_ours]['peak_mem_GiB'] / peers['compile']['peak_mem_GiB']:.2f}")
        # the `+adamw` rows: hubfuse's AdamW in place of torch's fused one, against the peers with torch's and
        # (where run) with hubfuse's AdamW too
        with_adamw = {c: by[(s, c + ADAMW_SUFFIX)] for c in CONFIGS
                      if by.get((s, c + ADAMW_SUFFIX), {}).get("status") == "ok"}
        ours_adamw = {c: r for c, r in with_adamw.items() if c in OURS}
        if ours_adamw:
            best = min(ours_adamw, key=lambda c: ours_adamw[c]["step_ms_median"])
            ms = ours_adamw[best]["step_ms_median"]
            line += (f"; with hubfuse.optim.AdamW: {best}{ADAMW_SUFFIX} {ms:.1f} ms, "
                     f"{peers[best_peer]['step_ms_median'] / ms:.2f}x {best_peer}")
            peers_adamw = {c: r for c, r in with_adamw.items() if c not in OURS}
            if peers_adamw:
                bp = min(peers_adamw, key=lambda c: peers_adamw[c]["step_ms_median"])
                line += f", {peers_adamw[bp]['step_ms_median'] / ms:.2f}x {bp}{ADAMW_SUFFIX}"
        lines.append(line + ".")
    return lines


def kernel_comparison(rows, top: int = 15) -> list[str]:
    """The profiler's top kernels of each eager hubfuse row next to its graph-replay row (`ours` / `ours_graph`,
    with the same optimizer and SDPA backend), ms and calls per step: which kernels slow down in replay."""
    by = {(r["slice"], r["config"]): r for r in rows}
    lines = []
    for r in rows:
        base, backend = split_config(r["config"])
        adamw = ADAMW_SUFFIX if uses_hubfuse_adamw(r["config"]) else ""
        replay = by.get((r["slice"], "ours_graph" + adamw + (f"@{backend}" if backend else "")), {})
        if base != "ours" or not r.get("top_kernels") or not replay.get("top_kernels"):
            continue
        eager_k = {name: (calls, ms) for name, calls, ms in r["top_kernels"]}
        replay_k = {name: (calls, ms) for name, calls, ms in replay["top_kernels"]}
        names = sorted(set(eager_k) | set(replay_k),
                       key=lambda n: -max(eager_k.get(n, (0, 0.0))[1], replay_k.get(n, (0, 0.0))[1]))[:top]
        lines += ["", f"Per-kernel GPU ms per step, {r['slice']}: {r['config']} (eager, "
                      f"{fmt(r.get('gpu_ms'), '.1f')} ms in all) vs {replay['config']} (graph replay, "
                      f"{fmt(replay.get('gpu_ms'), '.1f')} ms); blank: not in that row's top {len(r['top_kernels'])}",
                  "",
                  "| kernel | eager ms | replay ms | replay - eager | eager calls | replay calls |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name in names:
            (ce, me), (cr, mr) = eager_k.get(name, (None, None)), replay_k.get(name, (None, None))
            delta = mr - me if me is not None and mr is not None else None
            lines.append(f"| {name[:80].replace('|', '/')} | {fmt(me, '.2f')} | {fmt(mr, '.2f')} | "
                         f"{fmt(delta, '+.2f')} | {fmt(ce, '.0f')} | {fmt(cr, '.0f')} |")
    return lines


def row_key(row: dict) -> tuple:
    slice_order = list(SLICES)
    return (slice_order.index(row["slice"]) if row["slice"] in SLICES else len(SLICES), *config_key(row["config"]))


def final_lines(rows) -> list[str]:
    """What a run prints at its end (bench_train.md has the full table)."""
    return [*compact_table(rows), "", *summary(rows), *kernel_comparison(rows)]


def report(rows, meta, out_dir: Path, plots: bool) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_train.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    lines = [f"Training step (fwd + bwd + fused AdamW, bf16 weights), {meta.get('device')}; torch {meta.get('torch')}, "
             f"transformers {meta.get('transformers')}, kernels {meta.get('kernels')}, liger-kernel "
             f"{meta.get('liger-kernel')}, triton {meta.get('triton')}, flash-linear-attention "
             f"{meta.get('flash-linear-attention')}; host yardstick {meta.get('host_yardstick_us')} us "
             "(`sum(range(1000))`).",
             f"Command: `{meta.get('command')}`; median of {meta.get('steps')} steps after {meta.get('warmup')} "
             f"warm-up, each step synchronised; host = enqueue time of one step with the GPU queue drained; GPU = "
             f"summed kernel time per step; launches = CUDA launch calls per step made by the host.", "",
             "| slice | config | status | step ms | tokens/s | x eager | host ms | GPU ms | kernels | launches "
             "| peak GiB | loss step 1 | note |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    by = {(r["slice"], r["config"]): r for r in rows}
    for r in rows:
        e = by.get((r["slice"], "eager"), {})
        ratio = (r["tokens_per_s"] / e["tokens_per_s"]) if r.get("tokens_per_s") and e.get("tokens_per_s") else None
        lines.append(f"| {r['slice']} | {r['config']} | {r.get('status')} | {fmt(r.get('step_ms_median'), '.1f')} | "
                     f"{fmt(r.get('tokens_per_s'), '.0f')} | {fmt(ratio, '.2f')} | {fmt(r.get('host_ms'), '.1f')} | "
                     f"{fmt(r.get('gpu_ms'), '.1f')} | {fmt(r.get('kernels_per_step'), '.0f')} | "
                     f"{fmt(r.get('launches_per_step'), '.0f')} | {fmt(r.get('peak_mem_GiB'), '.2f')} | "
                     f"{fmt(r.get('loss_step1'), '.4f')} | {(r.get('note') or '')[:160].replace('|', '/')} |")
    lines += ["", *summary(rows), *kernel_comparison(rows)]
    (out_dir / "bench_train.md").write_text("\n".join(lines) + "\n")
    if plots:
        plot(rows, out_dir)
    return lines


def plot(rows, out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("(matplotlib not installed: no plots)")
        return
    slices = list(dict.fromkeys(r["slice"] for r in rows))
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    by = {(r["slice"], r["config"]): r for r in rows}
    for key, label, fname in (("tokens_per_s", "tokens / s (median step)", "bench_train_speed.png"),
                              ("peak_mem_GiB", "peak memory (GiB)", "bench_train_memory.png")):
        fig, ax = plt.subplots(figsize=(2.2 + 2.4 * len(slices), 4.2))
        width = 0.8 / max(len(configs), 1)
        for j, c in enumerate(configs):
            xs, ys, texts = [], [], []
            for i, s in enumerate(slices):
                r = by.get((s, c), {})
                v = r.get(key) if r.get("status") == "ok" else None
                xs.append(i + (j - (len(configs) - 1) / 2) * width)
                ys.append(v if v is not None else 0.0)
                texts.append(fmt(v, ".0f" if key == "tokens_per_s" else ".1f") if v is not None else
                             (r.get("status") or "n/a"))
            bars = ax.bar(xs, ys, width, label=c)
            for b, t in zip(bars, texts):
                ax.annotate(t, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=7, rotation=90 if len(t) > 6 else 0)
        ax.set_xticks(range(len(slices)))
        ax.set_xticklabels([SLICES[s]["title"] for s in slices])
        ax.set_ylabel(label)
        ax.set_title(f"training step (fwd+bwd+AdamW, bf16): {label}")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
        log(f"wrote {out_dir / fname}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slices", nargs="+", default=None, choices=list(SLICES),
                   help="default: every slice (smoke: one per family)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), type=parse_config, metavar="CONFIG[@BACKEND]",
                   help=f"of {list(CONFIGS)}; `@<backend>` ({', '.join(SDPA_BACKENDS)}) restricts SDPA to that "
                        f"backend for the run, e.g. ours_graph@cudnn")
    p.add_argument("--sdpa-backends", nargs="+", default=[], choices=list(SDPA_BACKENDS),
                   help="run every --configs entry once per SDPA backend (rows <config>@<backend>), e.g. "
                        "--configs ours ours_graph --sdpa-backends flash cudnn efficient")
    p.add_argument("--report-only", action="store_true",
                   help="print the tables of an existing bench_train.json (--out) and exit")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 15; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3; smoke 1)")
    p.add_argument("--host-steps", type=int, default=5, help="steps timed for the host's enqueue time (GPU)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (GPU)")
    p.add_argument("--cprofile", nargs="*", default=[], metavar="CONFIG",
                   help="print a cProfile of one step of these configs")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the slice's; smoke 32)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the slice's; smoke 2)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the slice's; smoke 2)")
    p.add_argument("--smoke", action="store_true", help="tiny dims on CPU (eager + ours; GPU-only modes skipped)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop launching runs after this many seconds; children are cut to what is left "
                        "(default 510; smoke 300)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply the per-run timeouts")
    p.add_argument("--timeouts", nargs="+", default=[], metavar="TUNING=S",
                   help=f"per-config run timeouts in seconds (default {TIMEOUT_S}), e.g. liger=330 (Liger's MoE "
                        f"autotunes for ~3.5 min on its first call)")
    p.add_argument("--out", default=None, help="output dir (default $OUT or ./out)")
    p.add_argument("--append", action="store_true", help="merge into an existing bench_train.json")
    p.add_argument("--model-dir", default=None, help="where the built models go (default: a mktemp dir, removed)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    # internal: child mode
    p.add_argument("--child-configs", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    d = dict(steps=2, warmup=1, budget_s=300) if args.smoke else dict(steps=15, warmup=3, budget_s=510)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.slices is None:
        args.slices = list(SMOKE_SLICES if args.smoke else SLICES)
    if args.child_configs:
        return child(args)
    if args.sdpa_backends:
        args.configs = [f"{split_config(c)[0]}@{b}" for c in args.configs for b in args.sdpa_backends]
    args.configs = sorted(dict.fromkeys(args.configs), key=config_key)
    for item in args.timeouts:
        c, _, v = item.partition("=")
        if c not in TIMEOUT_S or not v:
            p.error(f"--timeouts: expected TUNING=SECONDS with TUNING in {list(TIMEOUT_S)}, got {item!r}")
        TIMEOUT_S[c] = float(v)

    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "out")
    if args.report_only:
        if not (out_dir / "bench_train.json").exists():
            log(f"--report-only: no {out_dir / 'bench_train.json'}")
            return 2
        saved = json.loads((out_dir / "bench_train.json").read_text())
        log("\n".join(final_lines(sorted(saved["results"], key=row_key))))
        return 0
    t_begin = time.time()
    import torch

    from tests.utils import register_local_kernels

    from hubfuse import presets

    rows: list[dict] = []
    meta = env_meta(args.smoke)
    if args.append and (out_dir / "bench_train.json").exists():
        old = json.loads((out_dir / "bench_train.json").read_text())
        rows = old["results"]
        meta["earlier_commands"] = old["meta"].get("earlier_commands", []) + [old["meta"].get("command")]
        meta["earlier_host_yardsticks_us"] = (old["meta"].get("earlier_host_yardsticks_us", [])
                                              + [old["meta"].get("host_yardstick_us")])
    meta.update(command="python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
                steps=args.steps, warmup=args.warmup, smoke=args.smoke,
                slices={s: dict(title=SLICES[s]["title"], shape=shape_of(s, args)) for s in args.slices})

    def put(row):
        rows[:] = [r for r in rows if (r["slice"], r["config"]) != (row["slice"], row["config"])] + [row]

    # what runs: skipped rows get a note
    plan: list[tuple[str, list[str]]] = []
    for config in args.configs:
        base = split_config(config)[0]
        for name in args.slices:
            family = SLICES[name]["family"]
            if args.smoke and base not in ("eager", "ours"):
                put(dict(slice=name, config=config, status="skipped",
                         note="CPU smoke: compile, CUDA graphs and Liger run on the GPU only"))
            elif base in FLA and family != "qwen3_5_moe_text":
                put(dict(slice=name, config=config, status="unsupported",
                         note="flash-linear-attention: Gated DeltaNet models only"))
            elif base in FLA and not os.environ.get("HUBFUSE_FLA_SITE"):
                put(dict(slice=name, config=config, status="skipped",
                         note="flash-linear-attention: HUBFUSE_FLA_SITE (its site dir) not set"))
            elif base in LIGER and family not in LIGER_APPLY:
                put(dict(slice=name, config=config, status="unsupported",
                         note=f"liger-kernel has no apply_liger_kernel_to_* for {family}"))
            elif base in LIGER and meta.get("liger-kernel") is None:
                put(dict(slice=name, config=config, status="skipped", note="liger-kernel not installed"))
            else:
                plan.append((name, [config]))
    if args.smoke:  # one process per slice (CPU start-up time); the same child code path
        grouped: dict[str, list[str]] = {}
        for name, cs in plan:
            grouped.setdefault(name, []).extend(cs)
        plan = list(grouped.items())
    n_runs = sum(len(cs) for _, cs in plan)
    log(f"bench: {len(args.slices)} slice(s) x {len(args.configs)} config(s) -> {n_runs} run(s) in "
        f"{len(plan)} subprocess(es); {args.warmup} warm-up + {args.steps} measured steps; device {meta['device']}; "
        f"budget --budget-s {args.budget_s:.0f} s (runs that do not fit are skipped, their rows say so: rerun them "
        f"with --configs ... --append)")
    for k, (name, cs) in enumerate(plan, 1):
        layers, batch, seq = shape_of(name, args)
        log(f"  plan {k}: {name} ({layers} layers, {batch} x {seq}) / {'+'.join(cs)}")
    if args.dry_run:
        return 0
    if not args.smoke and not torch.cuda.is_available():
        log("no CUDA device: use --smoke for the CPU check")
        return 2
    if not args.smoke and meta.get("accelerate") is None:
        log("from_pretrained(device_map='cuda') needs accelerate (pip install accelerate): kernelize must see the "
            "final device at load time")
        return 2
    families = {SLICES[s]["family"] for s in args.slices}
    repos = sorted({r for f in families for r in presets.kernel_repos(f)})
    log(f"building kernel repos {repos} (scripts/build.py) ...")
    register_local_kernels(*repos)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # never the Triton interpreter: on the GPU it must not be set; on CPU (--smoke) our layers then run their
    # torch reference path, as any CPU user gets (the interpreter paths are the kernel tests' business)
    if env.pop("TRITON_INTERPRET", None) is not None:
        log("(TRITON_INTERPRET unset for the benchmark subprocesses)")

    tmp_owner = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp_owner = tempfile.TemporaryDirectory(prefix="hubfuse_bench_")
        model_dir = tmp_owner.name
    plots = not args.no_plots
    try:
        for k, (name, configs) in enumerate(plan, 1):
            elapsed = time.time() - t_begin
            left = args.budget_s - elapsed
            timeout = sum(TIMEOUT_S[split_config(c)[0]] for c in configs) * args.timeout_scale
            if not (Path(model_dir) / name / "DONE").exists():
                timeout += 120 * args.timeout_scale  # the slice's model is built and saved first
            tag = f"({k}/{len(plan)}) {name} / {'+'.join(configs)}"
            if left < (60 if {split_config(c)[0] for c in configs} & set(COMPILED) else 20):
                log(f"{tag}: skipped, time budget spent ({elapsed:.0f} s of {args.budget_s:.0f})")
                for c in configs:
                    put(dict(slice=name, config=c, status="skipped", note="time budget spent (--budget-s)"))
                continue
            timeout = min(timeout, left)
            log(f"{tag}: start (timeout {timeout:.0f} s; {elapsed:.0f} s elapsed)")
            fd, child_out = tempfile.mkstemp(prefix="hubfuse_bench_row_", suffix=".json")
            os.close(fd)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--slices", name, "--child-configs", *configs,
                   "--child-out", child_out, "--model-dir", model_dir, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--host-steps", str(args.host_steps),
                   "--profile-steps", str(args.profile_steps)] + (["--smoke"] if args.smoke else []) + [
                       f"--{k}={v}" for k, v in (("seq", args.seq), ("batch", args.batch), ("layers", args.layers))
                       if v is not None] + (["--cprofile", *args.cprofile] if args.cprofile else [])
            t0 = time.time()
            rc, tail = run_child(cmd, timeout, tag, env)
            try:
                got = json.loads(Path(child_out).read_text() or "[]")
            except (OSError, json.JSONDecodeError):
                got = []
            finally:
                Path(child_out).unlink(missing_ok=True)
            done = {r["config"]: r for r in got}
            for c in configs:
                r = done.get(c)
                if r is None or "status" not in r:
                    why = "timeout" if rc is None else f"crashed (exit {rc})"
                    r = dict(r or {}, slice=name, config=c, status="timeout" if rc is None else "error",
                             note=f"{why}; last output: " + " / ".join(tail[-3:])[-300:])
                put(r)
            log(f"{tag}: done in {time.time() - t0:.0f} s -> " +
                ", ".join(f"{c}: {done.get(c, {}).get('status', 'timeout' if rc is None else 'error')}" for c in configs))
            report(rows, meta, out_dir, plots=False)  # partial results survive a kill
    finally:
        if tmp_owner is not None:
            tmp_owner.cleanup()
    rows.sort(key=row_key)
    meta["wall_s"] = round(time.time() - t_begin, 1)
    report(rows, meta, out_dir, plots=plots)
    log("\n" + "\n".join(final_lines(rows)))
    log(f"wrote {out_dir / 'bench_train.json'} and {out_dir / 'bench_train.md'}; total {meta['wall_s']:.0f} s")
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
