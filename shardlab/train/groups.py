"""A user's parameter groups (``shardlab.initialize(model_parameters=...)`` or a ready optimizer's
``param_groups``) carried onto the tensors an engine optimises.

:func:`user_groups` turns what the user passed into ``[(param ids, settings)]``; :func:`regroup`
gives every engine tensor (a parameter, or a ZeRO flat shard packing several) the settings of its
parameters' group, or a ConfigError naming the parameters (docs/api.md, Parameter groups).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError


def user_groups(model: nn.Module, given) -> list[tuple[set[int], dict]]:
    """``given``: an iterable of parameters or of dicts ``{"params": [...], **settings}`` (torch's
    param-group format). Returns ``[(ids of its parameters, settings)]``; every parameter of
    ``model`` that requires grad must be in exactly one group."""
    items = list(given)
    if not items:
        raise ConfigError("model_parameters", "is empty; pass model.parameters() or a list of param groups")
    if all(isinstance(g, dict) for g in items):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ConfigError("model_parameters", f"group {i} has no \"params\" key")
            ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
            groups.append(({id(p) for p in ps}, {k: v for k, v in g.items() if k != "params"}))
    elif all(isinstance(p, torch.Tensor) for p in items):
        groups = [({id(p) for p in items}, {})]
    else:
        raise ConfigError("model_parameters", "expected parameters or param-group dicts (not a mix)")
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: set[int] = set()
    for ids, _ in groups:
        if stray := ids - set(trainable):
            raise ConfigError("model_parameters", f"{len(stray)} tensor(s) are not trainable parameters of the model")
        if ids & seen:
            raise ConfigError("model_parameters", "a parameter is in two groups; put each in one")
        seen |= ids
    if missing := [n for i, n in trainable.items() if i not in seen]:
        raise ConfigError("model_parameters", f"leaves out {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                                              "shardlab optimises every parameter that requires grad; set "
                                              "requires_grad=False on those it must not train")
    return groups


def regroup(engine_groups: list[dict], groups: list[tuple[set[int], dict]], names: dict[str, int],
            flats, weight_decay: float) -> list[dict]:
    """The optimizer's groups: one per user group (in its order), holding the engine tensors
    whose parameters are in it, with the user group's settings. ``names``: the model's parameter
    names -> ids (taken before the engine re-parameterises the model); ``flats``: the engine's
    FlatParams (none for DDP); a group without ``weight_decay`` gets ``weight_decay``."""
    by_shard = {id(f.shard): f for f in flats or ()}
    owner = {pid: k for k, (ids, _) in enumerate(groups) for pid in ids}
    out = [{"params": [], **{"weight_decay": weight_decay, **s}} for _, s in groups]
    for tensor in (p for g in engine_groups for p in g["params"]):
        if id(tensor) in owner:
            ks = {owner[id(tensor)]}
        elif id(tensor) in by_shard:
            ks = {owner[names[n]] for n in by_shard[id(tensor)].names if names.get(n) in owner}
        else:
            raise ConfigError("model_parameters", "the engine optimises a tensor that no parameter name maps to")
        if len({repr(groups[k][1]) for k in ks}) > 1:
            f = by_shard[id(tensor)]
            raise ConfigError("model_parameters", f"ZeRO packs {', '.join(f.names[:4])} into one flat shard but they are "
                              "in param groups with different settings; group matrices apart from biases/norms (the "
                              "engines' own split), give the groups equal settings, or use zero_optimization.stage 0")
        out[min(ks)]["params"].append(tensor)
    return [g for g in out if g["params"]]
