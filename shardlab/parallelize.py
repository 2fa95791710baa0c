"""The one place that composes parallel modules, in a fixed order:

    TP(+SP) -> EP -> CP -> PP -> activation checkpointing / compile -> ZeRO/FSDP or DDP

``parallelize(model, mesh, cfg)`` returns an :class:`Engine`: what the train loop drives.
An Engine owns the local module and knows how to run forward+backward over the step's
micro-batches, how gradients are synchronised, how to build the optimizer, and how its local
tensors map to global ones (for the gradient norm and for checkpoints).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import Config
from .distributed.mesh import Mesh
from .distributed.placement import get_placement, replicas


class Engine:
    """Base engine: a model replicated on every rank, gradients averaged over ``dp_cp`` after
    backward (one all-reduce per parameter). Parallel modules subclass or replace this."""

    name = "replicated"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        self.model, self.mesh, self.cfg = model, mesh, cfg

    # -- the step --------------------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float = 1.0, autocast=None) -> torch.Tensor:
        """Accumulate gradients of the mean loss over all micro-batches and data-parallel ranks.
        Returns the local mean loss (detached) for logging."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        for x, y in micro_batches:
            with autocast() if autocast else _null():
                loss = self.model(x, y)
            (loss * (loss_scale / n)).backward()
            total += loss.detach().double()
        self.sync_grads()
        return total / n

    def sync_grads(self):
        comm = self.mesh.comm("dp_cp")
        for p in self.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, op="avg")

    def global_loss(self, local: torch.Tensor) -> float:
        """Mean of the local losses over the ranks that compute a loss."""
        t = local.detach().clone().to(torch.float64)
        return float(self.mesh.comm("dp_cp").all_reduce(t, op="avg"))

    # -- optimizer and norms ---------------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def named_parameters(self):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def make_optimizer(self, build):
        """``build(param_groups)`` -> optimizer. ZeRO engines wrap or shard it."""
        return build(self.param_groups())

    def param_groups(self):
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        return [{"params": decay, "weight_decay": self.cfg.train.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient, each global element counted once: every rank adds
        its local squares divided by the number of identical copies (placement.py), then one
        all-reduce over the world."""
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for name, p in self.named_parameters():
            if p.grad is not None:
                pl = get_placement(p, name)
                sq += pl.valid(p.grad.detach()).double().pow(2).sum() / replicas(pl, self.mesh)
        if self.mesh.world_size > 1:
            self.mesh.comm("world").all_reduce(sq)
        return sq.sqrt()

    def clip_grads(self, max_norm: float) -> float:
        norm = self.grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        return float(norm)

    # -- checkpoints (global coordinates) ----------------------------------------------------
    def full_state(self, optimizer) -> dict[str, torch.Tensor]:
        """Global tensors ``model.<name>`` and ``optim.<name>.<state>`` (complete on rank 0)."""
        out = {f"model.{n}": p.detach().cpu() for n, p in self.model.state_dict(keep_vars=False).items()}
        names = {id(p): n for n, p in self.named_parameters()}
        for p, st in optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"optim.{names[id(p)]}.{k}"] = v.detach().cpu()
        return out

    def load_full_state(self, state: dict[str, torch.Tensor], optimizer) -> None:
        model_sd = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        self.model.load_state_dict(model_sd, strict=True)
        for name, p in self.named_parameters():
            keys = [k for k in state if k.startswith(f"optim.{name}.")]
            if keys:
                optimizer.state[p] = {k.rsplit(".", 1)[1]: state[k].to(p.device) for k in keys}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> Engine:
    """Apply the parallelisms the config asks for, in the fixed order of the module doc."""
    p = cfg.parallel
    unsupported = [name for name, on in (("tp", p.tp > 1), ("pp", p.pp > 1), ("cp", p.cp > 1),
                                         ("ep", p.ep > 1)) if on]
    if unsupported:
        raise NotImplementedError(f"parallel.{unsupported[0]} is not implemented yet in this build")
    if p.compile:
        for key, block in model.layers.items():
            model.layers[key] = torch.compile(block)
    # Last: how data-parallel ranks share model state (parallel/data.py, zero.py, fsdp.py).
    from .parallel import data, fsdp, zero
    if p.zero_stage == 3:
        return fsdp.apply(model, mesh, cfg)
    if p.zero_stage in (1, 2):
        return zero.apply(model, mesh, cfg)
    if mesh.size("dp_cp") > 1:
        return data.apply(model, mesh, cfg)
    return Engine(model, mesh, cfg)
