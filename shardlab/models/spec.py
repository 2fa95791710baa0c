"""The model plug-in point: one :class:`ModelSpec` per architecture, registered by name.

``model.arch`` in the config picks a spec; everything outside ``shardlab/models/`` asks the spec,
never a model class: how to build the model (on the meta device), the initial value of every
parameter by global name, the blocks (FSDP units, activation checkpointing, pipeline split),
the tensor-parallel plan, where the attention cores are (context parallel, selective
recomputation), which modules the first and last pipeline stages own, the FLOPs per token (MFU),
and the architecture's own config checks. A parallelism the spec leaves out (``tp_plan=None``,
``attention=None``, ``pp_first=None``) is refused by ``validate()`` naming the field.

Adding an architecture = one package under ``shardlab/models/`` whose ``__init__`` calls
:func:`register` (found on first use), or ``model.arch = "package.module:SPEC"`` naming a
ModelSpec kept anywhere on the Python path (nothing in shardlab changes).

Conventions a transformer spec follows (Llama and GPT-2 do): the model's ``forward(tokens,
targets=None, positions=None)`` returns logits or the mean loss; its repeated blocks are the
``layers`` ModuleDict keyed by global index; the modules named in ``pp_first`` / ``pp_last`` may
be None (a pipeline stage that does not own them) and ``forward`` then takes / returns hidden states.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .init import init_box


@dataclass(frozen=True)
class ModelSpec:
    """How shardlab builds, initialises, splits and counts one architecture."""

    name: str
    """The ``model.arch`` value that selects this spec."""
    build: Callable[..., nn.Module]
    """``build(model_cfg) -> nn.Module``; called under ``torch.device("meta")``."""
    init_std: Callable[..., float | None]
    """``init_std(name, global_shape, model_cfg)``: std of the normal init of a parameter by global
    name; None = ones (norm weights), 0.0 = zeros (biases)."""
    flops_per_token: Callable[..., float]
    """``flops_per_token(model_cfg, seq_len)``: training FLOPs per token (forward + backward), for MFU."""
    blocks: Callable[[nn.Module], dict[str, nn.Module]]
    """``blocks(model) -> {global name: module}``: the repeated blocks, in forward order (FSDP's
    default units, activation checkpointing, the pipeline split)."""
    task: str = "lm"
    """``lm``: token sequences, next-token loss (train/data.py); ``classify``: images and labels
    (train/images.py), accuracy reported."""
    tp_plan: dict | None = None
    """Tensor-parallel plan: {module name pattern: style} (parallel/tensor.py); None = no TP."""
    attention: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    """``attention(model) -> [(owner, attribute)]`` of every attention core ``core(q, k, v, causal)``;
    context parallel swaps them, selective recomputation wraps them. None = no CP."""
    pp_first: tuple[str, ...] | None = None
    """Modules (attribute names of the model) only the first pipeline stage owns; None = no PP."""
    pp_last: tuple[str, ...] = ()
    """Modules only the last pipeline stage owns (it computes the loss)."""
    ffn_dim: Callable[..., int] | None = None
    """``ffn_dim(model_cfg)``: hidden size of the MLP, split by tensor parallel (checked divisible by tp)."""
    moe: bool = False
    """Supports Mixture-of-Experts blocks (``model.n_experts > 0``, expert parallel)."""
    check: Callable[..., None] | None = None
    """``check(cfg)``: the architecture's own constraints; raise ConfigError naming the field."""
    sample_batch: Callable[..., tuple] | None = None
    """``sample_batch(cfg, batch, generator) -> (inputs, targets)``: random inputs of the model's kind
    (memory measurement, benchmarks); None = ``batch`` random token sequences of ``train.seq_len``."""
    verify_model: dict = field(default_factory=dict)
    """Overrides of the tiny float64 model of the parity matrix (``analysis/verify.BASE["model"]``)
    that this architecture needs (e.g. ``{"n_kv_heads": 0}`` without grouped-query attention)."""


_REGISTRY: dict[str, ModelSpec] = {}
_discovered = False


def register(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` selectable as ``model.arch = spec.name`` (a later registration replaces it)."""
    _REGISTRY[spec.name] = spec
    return spec


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = __name__.rpartition(".")[0]  # shardlab.models: its sub-packages, found on disk
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.ispkg:
            importlib.import_module(f"{package}.{info.name}")


def specs() -> dict[str, ModelSpec]:
    """Every registered architecture by name."""
    _discover()
    return dict(_REGISTRY)


def get_spec(arch) -> ModelSpec:
    """The spec of ``arch`` (a name, or a ModelConfig); ConfigError naming model.arch if unknown.
    ``"package.module:NAME"`` imports that module and uses its ModelSpec ``NAME``: an architecture
    kept outside shardlab (every rank resolves it by the same import)."""
    name = arch if isinstance(arch, str) else arch.arch
    _discover()
    if name not in _REGISTRY and ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attr, None)
        except ImportError as e:
            raise ConfigError("model.arch", f"cannot import {module!r} ({e}); write package.module:SPEC "
                                            "with the module on the Python path") from None
        if not isinstance(found, ModelSpec):
            raise ConfigError("model.arch", f"{module}.{attr} is not a ModelSpec; point at a ModelSpec object")
        _REGISTRY[name] = found
    if name not in _REGISTRY:
        import difflib
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError("model.arch", f"unknown architecture {name!r}{hint}; registered: "
                                        f"{', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


# -- building and initialising any registered architecture ----------------------------------------

def init_tensor(name: str, shape, cfg, seed: int, dtype=torch.float32, offsets=None, sizes=None,
                device="cpu") -> torch.Tensor:
    """The global initial value of parameter ``name`` (same on every rank, under every layout), or
    only its box ``[offsets, offsets + sizes)``, drawn without building the rest (models/init.py)."""
    from . import lora
    std = lora.init_std(name, tuple(shape)) if lora.is_adapter(name) else get_spec(cfg).init_std(name, tuple(shape), cfg)
    return init_box(name, shape, std, seed, offsets, sizes, dtype, device)


def meta_model(cfg, dtype=torch.float32) -> nn.Module:
    """The model on the meta device: shapes and names, no storage. ``parallelize`` decides what
    each rank owns, then materialises only that (parallel/materialize.py)."""
    with torch.device("meta"):
        return get_spec(cfg).build(cfg).to(dtype)


@torch.no_grad()
def init_weights(model: nn.Module, cfg, seed: int) -> nn.Module:
    """Materialise every parameter (meta or real) from its global name. Returns the model."""
    sites: dict[int, list] = {}
    for mod in model.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                sites.setdefault(id(p), []).append((mod, attr))
    for name, p in list(model.named_parameters(remove_duplicate=True)):
        if p.is_meta:
            new = nn.Parameter(init_tensor(name, p.shape, cfg, seed, p.dtype), requires_grad=p.requires_grad)
            for mod, attr in sites[id(p)]:  # tied weights: every holder gets the same parameter
                mod._parameters[attr] = new
        else:
            p.copy_(init_tensor(name, p.shape, cfg, seed, torch.float32).to(p.dtype))
    return model


def add_adapters(model: nn.Module, train_cfg) -> list[str]:
    """LoRA adapters per ``train.lora_*`` (models/lora.py); ConfigError when no linear matches."""
    from . import lora
    wrapped = lora.apply(model, train_cfg.lora_rank, train_cfg.lora_alpha, train_cfg.lora_dropout,
                         train_cfg.lora_targets)
    if not wrapped:
        raise ConfigError("train.lora_targets", f"{train_cfg.lora_targets} match no nn.Linear of the model; "
                                                "use module-name patterns such as layers.*")
    return wrapped


def build_model(cfg, seed: int, device="cpu", dtype=torch.float32) -> nn.Module:
    """The whole model, materialised with layout-independent init (single-process reference)."""
    return init_weights(meta_model(cfg, dtype), cfg, seed).to(device=device)


def count_params(model: nn.Module) -> int:
    """Parameters, each shared tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def sample_batch(cfg, batch: int, generator: torch.Generator) -> tuple:
    """Random (inputs, targets) for the configured architecture (see ``ModelSpec.sample_batch``)."""
    spec = get_spec(cfg.model)
    if spec.sample_batch is not None:
        return spec.sample_batch(cfg, batch, generator)
    tok = torch.randint(0, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=generator)
    return tok[:, :-1], tok[:, 1:]


def layer_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """``blocks`` of a model whose repeated blocks are the ``layers`` ModuleDict."""
    return {f"layers.{k}": m for k, m in model.layers.items()}
