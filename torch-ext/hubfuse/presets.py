"""Presets: one KernelConfig mapping per model family that turns on every hubfuse kernel that applies to it,
plus the per-instance loss switches that KernelConfig cannot reach. `hubfuse.KernelConfig()` (no mapping) applies
both for the family of the model being loaded; by hand:

    from hubfuse import KernelConfig, presets
    model = AutoModelForCausalLM.from_pretrained(ckpt, use_kernels=True,
                                                 kernel_config=KernelConfig(presets.kernel_mapping("qwen3")))
    presets.enable_losses(model, "qwen3")     # fused linear cross-entropy (+ fused aux loss for MoE)
    model.train()

Kernel versions: `revision` if given, else `version` if given, else `revision="v1"` for a repo with a local build
(LOCAL_KERNELS, `hubfuse.use_local_builds()`) and `version=1` (the hub) otherwise.

Families: `qwen3` (dense), `qwen3_moe`, `qwen3_5_moe` (the text model classes; `qwen3_5_moe_text` is an alias),
`llama`, `qwen2`.

Choices where two of our kernels cover the same modules (measured on H200, bf16, fwd+bwd, 16384 tokens,
hidden 4096, intermediate 12288):

- Dense decoder layers (qwen3, llama, qwen2): the `DecoderLayer` Layout (hubfuse/decoder-layer) over the
  per-module kernels below: the same kernels, bit for bit the same results and saved tensors, one autograd node a
  layer in eager training instead of five; Qwen3-0.6B step 86.7 / 90.3 against 99.3 / 104.4 ms (H100, one
  process, steps interleaved; docs/benchmarks.md "Dense step and host path").
- Per module (`decoder_layer=False`), dense decoder layers: the n-to-1 fusion `RMSNormSwiGLUMLP` over
  `(post_attention_layernorm, mlp)` instead of the 1-to-1 `SwiGLUMLP` Layout (+ the `RMSNorm` hub kernel on the
  post-attention norm). Fusion 22.32 ms vs SwiGLUMLP 22.39 ms + RMSNorm 0.56 ms = 22.95 ms per layer, and no
  more activation memory (1088 MiB vs 960 + 132 MiB). The two cannot be combined anyway (same modules, same
  checkpoint keys). The other norms (input_layernorm, final norm) keep the `RMSNorm` hub kernel.
- MoE families: the fusion needs a dense MLP under every decoder layer, so sparse models use the 1-to-1
  `SwiGLUMLP` Layout on their dense MLP class (Qwen3-MoE `mlp_only_layers`, Qwen3.5-MoE's shared expert).
- Attention: Layouts, bound per model instance. Qwen3 / Qwen3-MoE / Qwen3.5-MoE (`QKNormRopeAttention`,
  `GatedQKNormRopeAttention`) read each q/k head once for q_norm + k_norm + RoPE, instead of three passes (two
  `RMSNorm` launches and a RoPE launch). Llama / Qwen2 (no q/k norm: `RopeAttention`) run RoPE on q and k in one
  launch. The `rotary_pos_emb` hub name is never used by a preset: it binds the kernel to the family's
  module-global `apply_rotary_pos_emb`, so every later model of that family in the process would run it too (see
  kernel_repos/rotary/CARD.md); a Layout changes only the model it is loaded into.
- Qwen3.5-MoE linear attention: the `GatedDeltaNet` Layout (conv, gates, l2norm and the chunked rule fused,
  gated norm included) rather than the process-wide function hub names (`chunk_gated_delta_rule`,
  `causal_conv1d_fn`, ...). Its gated norm runs inside it, so the `RMSNormGated` entry binds no module there
  (kept for models without the Layout).

Every preset therefore binds per model instance: a plain model of the same class, loaded before or after a
kernelized one in the same process, runs stock transformers code.

Keys are anchored class-name regexes wherever the kernel ships a Layout: transformers treats a string key whose
kernel has a Layout as a regex over class names (`re.search`), so a bare "RMSNorm" would also swap every other
class whose name contains it. Only `SoftmaxTopKRouter` (no Layout) is a hub name: it binds to the classes
transformers registered under it, which only Qwen3.5-MoE has.

This module imports nothing beyond the standard library at import time (the umbrella hub kernel ships it).
"""
from __future__ import annotations

from .sources import ORG, check_not_version_on_local, default_meta

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5_moe", "llama", "qwen2")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe")
_ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}
# Preset entries that bind nothing on some models of the family (Qwen3-MoE's dense `mlp_only_layers`; Qwen3.5's
# gated norm, which the GatedDeltaNet Layout fuses): expected, not a mistake.
OPTIONAL_KEYS = frozenset({"^Qwen3MoeMLP$",
                           "^Qwen3_5MoeRMSNormGated$"})

# the n-to-1 fusion key of dense decoder layers (transformers matches the module paths; the first item of each
# pair is only a label)
FUSION_KEY = (("RMSNorm", "model.layers.*.post_attention_layernorm"), ("MLP", "model.layers.*.mlp"))


def _family(family: str, model: str | None = None) -> str:
    fam = _ALIASES.get(family, family)
    if fam not in FAMILIES:
        what = f"{model} (model_type {family!r})" if model else f"model family {family!r}"
        raise ValueError(f"hubfuse has no kernels for {what}; supported model types: {', '.join(FAMILIES)} "
                         f"(and 'qwen3_5_moe_text', the Qwen3.5-MoE text model). For another model, pass an explicit "
                         f"mapping to hubfuse.KernelConfig({{...}})")
    return fam


def family_of(model_type: str, model: str | None = None) -> str:
    """The preset family of a `config.model_type` (aliases resolved); ValueError listing the supported ones."""
    return _family(model_type, model)


def _layers(family: str, fuse_norm_mlp: bool = True, decoder_layer: bool = True) -> dict:
    """KernelConfig key -> (kernel repo, layer) for one family."""
    fam = _family(family)
    if fam in ("qwen3", "llama", "qwen2"):
        prefix = {"qwen3": "Qwen3", "llama": "Llama", "qwen2": "Qwen2"}[fam]
        layers = {f"^{prefix}RMSNorm$": ("rmsnorm", "RMSNorm")}  # the final norm (and the layers' without the Layout)
        if decoder_layer and fuse_norm_mlp:
            layers[f"^{prefix}DecoderLayer$"] = ("decoder-layer", "DecoderLayer")
            return layers
        layers[f"^{prefix}Attention$"] = ("rotary", "QKNormRopeAttention" if fam == "qwen3" else "RopeAttention")
        if fuse_norm_mlp:
            layers[FUSION_KEY] = ("swiglu", "RMSNormSwiGLUMLP")
        else:  # keeps the decoder layer class (FSDP wrap policies by class name), slightly slower
            layers[f"^{prefix}MLP$"] = ("swiglu", "SwiGLUMLP")
        return layers
    if fam == "qwen3_moe":
        return {"^Qwen3MoeRMSNorm$": ("rmsnorm", "RMSNorm"),
                "^Qwen3MoeAttention$": ("rotary", "QKNormRopeAttention"),
                "^Qwen3MoeExperts$": ("moe", "GroupedGemmExperts"),
                "^Qwen3MoeTopKRouter$": ("load-balancing-loss", "TopKRouter"),
                "^Qwen3MoeMLP$": ("swiglu", "SwiGLUMLP")}  # dense layers (mlp_only_layers), if any
    if fam == "qwen3_5_moe":
        return {"^Qwen3_5MoeRMSNorm$": ("rmsnorm", "RMSNormZeroCentered"),
                "^Qwen3_5MoeRMSNormGated$": ("rmsnorm", "RMSNormGated"),
                "SoftmaxTopKRouter": ("load-balancing-loss", "SoftmaxTopKRouter"),
                "^Qwen3_5MoeAttention$": ("rotary", "GatedQKNormRopeAttention"),
                "^Qwen3_5MoeGatedDeltaNet$": ("gated-delta-net", "GatedDeltaNet"),
                "^Qwen3_5MoeExperts$": ("moe", "GroupedGemmExperts"),
                "^Qwen3_5MoeMLP$": ("swiglu", "SwiGLUMLP")}  # the shared expert
    raise AssertionError(fam)


def _meta(repo_id: str, revision, version, trust_remote_code: bool = False) -> dict:
    """`revision` if given, else `version` if given, else `revision="v1"` for a local build (LOCAL_KERNELS, see
    `hubfuse.use_local_builds`) and `version=1` for the hub."""
    if revision is not None:
        meta = {"revision": revision}
    elif version is not None:
        meta = {"version": version}
    else:
        meta = default_meta(repo_id)
    if trust_remote_code:
        meta["trust_remote_code"] = True
    return meta


def kernel_mapping(family: str, org: str = ORG, revision: str | None = None, version: int | None = None, *,
                   decoder_layer: bool = True, fuse_norm_mlp: bool = True, trust_remote_code: bool = False) -> dict:
    """The `KernelConfig` mapping that turns on every hubfuse kernel applying to `family`.

    `revision` wins over `version`; with neither, each repo gets `revision="v1"` if it is a local build
    (LOCAL_KERNELS, `hubfuse.use_local_builds()`) and `version=1` otherwise.
    Dense families (qwen3, llama, qwen2):
    - `decoder_layer=True` (default): the `DecoderLayer` Layout (hubfuse/decoder-layer) replaces the decoder layer,
      one autograd node a layer in eager training, and the `RMSNorm` Layout the final norm;
    - `decoder_layer=False`: per-module Layouts, the attention Layout and the RMSNorm + MLP fusion;
    - `fuse_norm_mlp=False`: per-module Layouts with the 1-to-1 `SwiGLUMLP` Layout instead of the fusion, the one
      choice that keeps the stock decoder layer class (the others build `DecoderLayerLayout`, or the fusion's
      subclass `FusedQwen3DecoderLayer`; `hubfuse.KernelConfig` adds that name to the model's `_no_split_modules`,
      which accelerate's FSDP `TRANSFORMER_BASED_WRAP` reads, but an explicit wrap list must name it).
    Pass the result to `hubfuse.KernelConfig` (training, CPU) or transformers' own (CUDA inference).
    """
    return {key: (f"{org}/{repo}:{layer}", _meta(f"{org}/{repo}", revision, version, trust_remote_code))
            for key, (repo, layer) in _layers(family, fuse_norm_mlp, decoder_layer).items()}


def kernel_repos(family: str) -> tuple[str, ...]:
    """The kernel repos (names under the org) a family's preset and loss hooks use."""
    repos = {repo for options in ((True, True), (True, False), (False, True))
             for repo, _ in _layers(family, *options).values()} | {"cross-entropy"}
    if _family(family) in MOE_FAMILIES:
        repos.add("load-balancing-loss")
    return tuple(sorted(repos))


def known_repos() -> tuple[str, ...]:
    """Every kernel repo name the presets use, and the umbrella `hubfuse`: what the hubfuse org publishes."""
    return tuple(sorted({repo for family in FAMILIES for repo in kernel_repos(family)} | {"hubfuse"}))


def _loss_kernel(org, repo, revision, version, trust_remote_code):
    from kernels import get_kernel

    repo_id = f"{org}/{repo}"
    meta = _meta(repo_id, revision, version, trust_remote_code)
    check_not_version_on_local(repo_id, meta, "hubfuse.presets.enable_losses")
    return get_kernel(repo_id, **meta)


def enable_losses(model, family: str, org: str = ORG, revision: str | None = None, version: int | None = None,
                  trust_remote_code: bool = False, aux_loss_group=None, **ce_options):
    """Switch this model instance to the fused losses: the linear cross-entropy (loss from the last hidden
    states, no logits when labels are given) and, for MoE families, the fused router aux loss given to it as its
    `aux_loss_fn`.

    Per instance: the class and other instances keep HF's forward. `ce_options` go to the cross-entropy
    kernel's `enable_fused_loss` (e.g. `z_loss_weight`, `return_logits=True`). `aux_loss_group` (MoE, data
    parallel: e.g. `torch.distributed.group.WORLD`): the aux loss's load-balancing statistics are reduced over
    that process group (global-batch balancing, see docs/distributed.md); None: per rank, as transformers does.
    Returns the model.
    """
    kernel = dict(org=org, revision=revision, version=version, trust_remote_code=trust_remote_code)
    if _family(family) in MOE_FAMILIES:
        lbl = _loss_kernel(repo="load-balancing-loss", **kernel)
        ce_options.setdefault("aux_loss_fn", lbl.load_balancing_loss_func if aux_loss_group is None
                              else lbl.group_load_balancing_loss_func(aux_loss_group))
    _loss_kernel(repo="cross-entropy", **kernel).enable_fused_loss(model, **ce_options)
    return model


def disable_losses(model, family: str, org: str = ORG, revision: str | None = None, version: int | None = None,
                   trust_remote_code: bool = False):
    """Undo `enable_losses` on this instance. Returns the model."""
    _family(family)
    kernel = dict(org=org, revision=revision, version=version, trust_remote_code=trust_remote_code)
    _loss_kernel(repo="cross-entropy", **kernel).disable_fused_loss(model)
    return model


def eager_to_kernelized(eager: dict, kernelized_names) -> dict:
    """Map tensors keyed by the HF parameter names (grads, weights) onto a preset-kernelized model's names.

    `gate_up_proj` = cat(`gate_proj`, `up_proj`) along dim 0; under the RMSNorm+MLP fusion the MLP lives at
    `post_attention_layernorm.{gate_up_proj,down_proj}` instead of `mlp.*`. Raises KeyError if a kernelized
    name has no source, ValueError if some HF tensors were not used (a parameter the kernelized model lost).
    """
    import torch

    out, used = {}, set()
    for name in kernelized_names:
        src = name
        for part in ("gate_up_proj", "down_proj"):
            src = src.replace(f"post_attention_layernorm.{part}.", f"mlp.{part}.")
        if src in eager:
            out[name] = eager[src]
            used.add(src)
        elif ".gate_up_proj." in src:
            gate, up = src.replace(".gate_up_proj.", ".gate_proj."), src.replace(".gate_up_proj.", ".up_proj.")
            if gate not in eager or up not in eager:
                raise KeyError(f"{name}: neither {src} nor {gate} + {up} in the eager tensors")
            out[name] = torch.cat([eager[gate], eager[up]], dim=0)
            used.update((gate, up))
        else:
            raise KeyError(f"{name}: no eager tensor {src}")
    unused = set(eager) - used
    if unused:
        raise ValueError(f"eager tensors with no kernelized counterpart: {sorted(unused)}")
    return out


def bound_kernels(model) -> dict[str, int]:
    """What runs hubfuse kernels in `model`: "<module class>-><kernel layer>" -> the number of submodules whose
    forward kernelize bound to that layer, and the per-instance fused losses (`enable_losses`, read through the
    cross-entropy kernel's `fused_loss_options`)."""
    import sys

    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        func = getattr(module.__dict__.get("forward"), "__func__", None)
        # kernelize binds a Layer's `forward` method; a plain function is a per-instance hook (lm_head's fused loss)
        if name and func is not None and func is not type(module).forward and "." in func.__qualname__:
            key = f"{type(module).__name__}->{func.__qualname__.split('.')[0]}"
            counts[key] = counts.get(key, 0) + 1
    # the instance forward's module is the cross-entropy kernel's integration module when the fused loss is on
    loss_hook = sys.modules.get(getattr(getattr(model.__dict__.get("forward"), "__func__", None), "__module__", ""))
    options = getattr(loss_hook, "fused_loss_options", lambda _: None)(model)
    if options is not None:
        counts["loss->linear_cross_entropy"] = 1
        if getattr(options["aux_loss_fn"], "__name__", None) == "load_balancing_loss_func" and \
                "load_balancing_loss" in options["aux_loss_fn"].__module__:
            counts["aux loss->load_balancing_loss"] = 1
    return counts


__all__ = ["FAMILIES", "MOE_FAMILIES", "FUSION_KEY", "OPTIONAL_KEYS", "bound_kernels", "family_of", "kernel_mapping",
           "kernel_repos", "known_repos", "enable_losses", "disable_losses", "eager_to_kernelized"]
