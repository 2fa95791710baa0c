"""The model plug-in point: one :class:`ModelSpec` per architecture, registered by name and picked
by ``model.arch``; everything outside ``shardlab/models/`` asks the spec, never a model class. A
parallelism the spec leaves out is refused by ``validate()`` naming the field. Fields, conventions
and how to add an architecture (a package here, or ``"package.module:SPEC"``): docs/models.md.
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
from .init import init_box, meta_device


@dataclass(frozen=True)
class Sizes:
    """An architecture's typed size rules: what a 0 in ModelConfig's size fields means for it."""

    ffn_ratio: tuple[int, int] | None = None
    """MLP width when ``model.ffn_hidden`` is 0: ``int(num * d_model / den)`` rounded up to
    ``ffn_multiple_of`` (Llama: (8, 3) and 32; GPT-2: (4, 1)); None = no MLP rule."""
    ffn_multiple_of: int = 1

    def ffn_dim(self, cfg) -> int:
        if cfg.ffn_hidden or self.ffn_ratio is None:
            return cfg.ffn_hidden
        num, den = self.ffn_ratio
        k = self.ffn_multiple_of
        return k * ((int(num * cfg.d_model / den) + k - 1) // k)


@dataclass(frozen=True)
class ModelSpec:
    """How shardlab builds, initialises, splits and counts one architecture."""

    name: str
    """The ``model.arch`` value that selects this spec."""
    build: Callable[..., nn.Module]
    """``build(model_cfg) -> nn.Module``; called under ``torch.device("meta")`` (``models.init.meta_device``:
    fills of meta tensors, ``nn.init`` among them, are skipped; values are drawn per box later)."""
    init_std: Callable[..., float | None]
    """``init_std(name, global_shape, model_cfg)``: std of a parameter's normal init; None = ones, 0.0 = zeros."""
    flops_per_token: Callable[..., float]
    """``flops_per_token(model_cfg, seq_len)``: training FLOPs per token (forward + backward), for MFU."""
    blocks: Callable[[nn.Module], dict[str, nn.Module]]
    """``blocks(model) -> {global name: module}``: the repeated blocks in forward order (FSDP, AC, PP)."""
    task: str = "lm"
    """``lm``: token sequences, next-token loss; ``classify``: images and labels, accuracy reported."""
    tp_plan: dict | None = None
    """Tensor-parallel plan: {module name pattern: style} (parallel/tensor.py); None = no TP."""
    attention: Callable[[nn.Module], list[tuple[nn.Module, str]]] | None = None
    """``attention(model) -> [(owner, attribute)]`` of every core ``core(q, k, v, causal)``; None = no CP."""
    pp_first: tuple[str, ...] | None = None
    """Attributes of the model only the first pipeline stage owns; None = no PP."""
    pp_last: tuple[str, ...] = ()
    """Modules only the last pipeline stage owns (it computes the loss)."""
    sizes: Sizes = Sizes()
    """The typed size rules (the MLP width)."""
    ffn_dim: Callable[..., int] | None = None
    """``ffn_dim(model_cfg)``: the MLP width TP splits (default: ``sizes.ffn_dim`` where it has a rule)."""
    moe: bool = False
    """Supports Mixture-of-Experts blocks (``model.n_experts > 0``, expert parallel)."""
    check: Callable[..., None] | None = None
    """``check(cfg)``: the architecture's own constraints; raise ConfigError naming the field."""
    sample_batch: Callable[..., tuple] | None = None
    """``sample_batch(cfg, batch, generator) -> (inputs, targets)``; None = random token sequences."""
    verify_model: dict = field(default_factory=dict)
    """Overrides of the parity matrix's tiny model (``analysis/verify.BASE["model"]``) it needs."""
    hf: object = None
    """The Hugging Face adapter, a module (models/hf.py); None = none."""
    gguf: object = None
    """The GGUF adapter, a module (models/gguf.py); None = none."""

    def __post_init__(self):
        if self.ffn_dim is None and self.sizes.ffn_ratio is not None:
            object.__setattr__(self, "ffn_dim", self.sizes.ffn_dim)


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


def ffn_dim(model_cfg) -> int:
    """MLP width of ``model_cfg``: ``model.ffn_hidden``, or its architecture's rule (ModelConfig.ffn_dim)."""
    spec = get_spec(model_cfg)
    return spec.ffn_dim(model_cfg) if spec.ffn_dim is not None else model_cfg.ffn_hidden


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
    with meta_device():
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
