"""ZeRO-3 units: which modules' parameters are gathered and freed together (``parallel.wrap_policy``),
and what each unit packs. The engine (fsdp.py) and the planner (analysis/plan_memory.py) share
these rules, so a prediction's units are the run's."""
from __future__ import annotations

from torch import nn


def wrap_policy(model: nn.Module, policy: str, spec=None) -> list[str]:
    """Unit names from ``parallel.wrap_policy``: ``blocks`` (the architecture's blocks, from its
    ModelSpec; for a model without a spec, its repeated blocks: :func:`repeated_blocks`),
    ``size:<N>`` or ``class:<Name>[,<Name>]``."""
    kind, _, arg = policy.partition(":")
    if kind == "blocks":
        return list(spec.blocks(model)) if spec is not None else block_units(model)
    if kind == "size":
        return size_policy(model, int(arg))
    if kind == "class":
        return class_policy(model, tuple(a.strip() for a in arg.split(",") if a.strip()))
    raise ValueError(f"parallel.wrap_policy: unknown policy {policy!r}; use blocks, size:<N> or class:<Name>")


def repeated_blocks(model: nn.Module) -> list[str]:
    """A user model's blocks, as FSDP users wrap them by hand: the children of every outermost
    ModuleList / Sequential that holds two or more modules of one class with trainable parameters
    (a transformer's layers, a ResNet stage's blocks; ModuleLists are never called, so a list of
    them is looked into, as :func:`size_policy` does). None (the root unit only) where a block
    shares a parameter with anything outside it (a unit must own its parameters)."""
    out: list[str] = []
    for name, mod in model.named_modules():
        kids = list(mod.named_children())
        if (not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(kids) < 2
                or len({type(k) for _, k in kids}) > 1 or any(name.startswith(u + ".") for u in out)
                or isinstance(kids[0][1], (nn.ModuleList, nn.ModuleDict))  # never called: look inside them
                or not all(any(p.requires_grad for p in k.parameters()) for _, k in kids)):
            continue
        out += [f"{name}.{k}" if name else k for k, _ in kids]
    return [] if any(len(owners) > 1 for owners in _owners(model, out)) else out


def _owners(model: nn.Module, units: list[str]) -> list[set[str]]:
    """For each parameter (tied ones once): the units among ``units`` that hold it ("" the root)."""
    where: dict[int, set[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        where.setdefault(id(p), set()).add(next((u for u in units if pname.startswith(u + ".")), ""))
    return list(where.values())


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def block_units(model: nn.Module) -> list[str]:
    """``wrap_policy = blocks`` on a user model: its repeated blocks (:func:`repeated_blocks`) and,
    outside them, each outermost module with at least as many trainable parameters as the smallest
    block (an LLM's embedding and output head; DeepSpeed gathers module by module), in registration
    order. Such a module that shares a parameter with anything outside it (tied embeddings) stays
    in the root unit; containers holding blocks and ModuleLists / ModuleDicts (never called) are
    looked into."""
    blocks = repeated_blocks(model)
    if not blocks:
        return []
    modules = dict(model.named_modules())
    floor = min(_trainable(modules[b]) for b in blocks)
    extra: list[str] = []
    for name, mod in modules.items():  # registration order: a module before those inside it
        if (name and not isinstance(mod, (nn.ModuleList, nn.ModuleDict))
                and not any(name == u or name.startswith(u + ".") for u in blocks + extra)
                and not any(b.startswith(name + ".") for b in blocks) and _trainable(mod) >= floor):
            extra.append(name)
    shared = {u for owners in _owners(model, blocks + extra) if len(owners) > 1 for u in owners}
    order = {name: i for i, name in enumerate(modules)}
    return sorted(blocks + [e for e in extra if e not in shared], key=order.__getitem__)


def class_policy(model: nn.Module, class_names: tuple[str, ...]) -> list[str]:
    """Wrap policy by module class: the outermost modules whose class name is in ``class_names``."""
    out = []
    for name, mod in model.named_modules():
        if name and type(mod).__name__ in class_names and not any(name.startswith(u + ".") for u in out):
            out.append(name)
    return out


def size_policy(model: nn.Module, min_params: int) -> list[str]:
    """Wrap policy by size: the outermost modules with at least ``min_params`` parameters (the
    root excluded), in registration order. Containers without a forward (ModuleList, ModuleDict)
    are never called, so their forward hooks would never gather: the policy looks inside them."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            continue
        if name and not any(name.startswith(u + ".") for u in out):
            if sum(p.numel() for p in mod.parameters()) >= min_params:
                out.append(name)
    return out


def unit_params(module: nn.Module, prefix: str, units: list[str]) -> list[tuple[str, nn.Parameter]]:
    """What unit ``prefix`` (``module``; "" the root) packs: its trainable parameters not inside
    another of ``units``, each once (the engine's and the planner's rule)."""
    seen, named = set(), []
    for name, p in module.named_parameters(prefix=prefix, remove_duplicate=False):
        owner = next((u for u in units if u != prefix and name.startswith(u + ".")), None)
        if owner is None and id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            named.append((name, p))
    return named
