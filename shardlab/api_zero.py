"""``shardlab.zero``: DeepSpeed's ``deepspeed.zero.GatheredParameters`` for ``shardlab.initialize``'s
ZeRO-3 engine (docs/api.md, ZeRO-3 on your model).

Under ZeRO-3 a parameter of ``engine.module`` holds no values outside its unit's forward (a
placeholder of size 0, parallel/fsdp.py); its values live in the ranks' flat shards. Inside
``with GatheredParameters(params):`` every given parameter holds its whole value on every rank,
so ``engine.module.state_dict()``, ``save_pretrained`` or reading a weight work there. With
``modifier_rank=r`` the values rank ``r`` holds when the block ends are written back into every
rank's shard (and so into the optimizer's fp32 master), as DeepSpeed's does. Collective: every
rank enters it with the same parameters. Parameters that are not ZeRO-3 placeholders (ZeRO 0-2,
buffers, frozen ones kept whole) are left as they are, as in DeepSpeed."""
from __future__ import annotations

import torch

__all__ = ["GatheredParameters"]


class GatheredParameters:
    """``GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``: DeepSpeed's
    signature. ``params``: a parameter or an iterable of them (``engine.module.parameters()``);
    ``modifier_rank``: the global rank whose changes are kept, None for read-only (changes are
    dropped on exit); ``fwd_module``: accepted and unused (DeepSpeed registers external parameters
    with it); ``enabled=False``: does nothing."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        flats = {}
        for p in (params if enabled and params is not None else []):
            f = getattr(p, "_shardlab_flat", None)
            if f is not None:
                flats[id(f)] = f
        self.flats = sorted(flats.values(), key=lambda f: f.seq)  # the same order on every rank
        self.modifier_rank = modifier_rank

    def __enter__(self):
        for f in self.flats:
            full = f.comm.all_gather(f.shard.detach().to(f.placeholders[0].device))
            for p, v in zip(f.placeholders, f.views(full)):
                p.data = v.to(p.dtype).clone()  # its own storage: in-place edits stay in it
        return self

    def __exit__(self, *exc):
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for f in self.flats:
                    self._write_back(f)
        finally:
            for f in self.flats:
                for p in f.placeholders:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return False

    def _write_back(self, f) -> None:
        """Rank ``modifier_rank``'s values into every rank's shard: broadcast over all the ranks
        holding a copy of this flat buffer (its shard group and the replicas), as initialize does."""
        comm = f.copies
        if self.modifier_rank not in comm.ranks:
            raise ValueError(f"modifier_rank: {self.modifier_rank} is not one of the data-parallel ranks "
                             f"{comm.ranks} holding these parameters; give one of them")
        flat = comm.broadcast(f.flatten([p.data for p in f.placeholders], f.shard.dtype).to(f.shard.device),
                              comm.ranks.index(self.modifier_rank))
        with torch.no_grad():
            f.shard.data.copy_(f.own(flat))


def __getattr__(name):
    if name == "Init":
        raise AttributeError("shardlab.zero.Init is not provided: build the model as usual (on every rank); "
                             "shardlab.initialize shards it (docs/api.md, ZeRO-3 on your model)")
    raise AttributeError(f"module 'shardlab.zero' has no attribute {name!r}")
