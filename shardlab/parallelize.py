"""The one place that composes parallel modules, in a fixed order:

    TP(+SP) -> EP -> CP -> activation checkpointing / compile -> PP -> ZeRO/FSDP or DDP

(Checkpointing and compile wrap each block in place; pipeline stages are views over the same
blocks, so wrapping before the split equals wrapping after it, and the stages never need
rebuilding.)

``parallelize(model, mesh, cfg)`` returns an :class:`Engine`: what the train loop drives.
An Engine owns the local module and knows how to run forward+backward over the step's
micro-batches, how gradients are synchronised, how to build the optimizer, and how its local
tensors map to global ones (for the gradient norm and for checkpoints).
"""
from __future__ import annotations

from contextlib import nullcontext
import torch
from torch import nn

from .config import Config
from .distributed.mesh import Mesh
from .distributed.placement import Placement, get_placement, replicas
from .distributed.reshard import gather_global, local_slice


class Engine:
    """Base engine: a model replicated on every rank, gradients averaged over ``dp_cp`` after
    backward (one all-reduce per parameter). Parallel modules subclass or replace this."""

    name = "replicated"

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        self.model, self.mesh, self.cfg = model, mesh, cfg
        # (tokens, targets) of a micro-batch -> what this rank feeds its model (context
        # parallel keeps this rank's load-balanced sequence shard).
        self.shard_batch = None

    def _local(self, x, y):
        return self.shard_batch(x, y) if self.shard_batch else (x, y)

    # -- the step --------------------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float = 1.0, autocast=None) -> torch.Tensor:
        """Accumulate gradients of the mean loss over all micro-batches and data-parallel ranks.
        Returns the local mean loss (detached) for logging."""
        n = len(micro_batches)
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        for x, y in micro_batches:
            x, y = self._local(x, y)
            with autocast() if autocast else nullcontext():
                loss = self.model(x, y)
            (loss * (loss_scale / n)).backward()
            total += loss.detach().double()
        self.sync_grads()
        return total / n

    @torch.no_grad()
    def evaluate(self, micro_batches, autocast=None) -> torch.Tensor:
        """Local mean loss over the micro-batches, no gradients."""
        total = torch.zeros((), device=self.mesh.device, dtype=torch.float64)
        for x, y in micro_batches:
            x, y = self._local(x, y)
            with autocast() if autocast else nullcontext():
                total += self.model(x, y).double()
        return total / len(micro_batches)

    def sync_grads(self):
        comm = self.mesh.comm("dp_cp")
        for name, p in self.named_parameters():
            if p.grad is None:
                continue
            if "ep" in get_placement(p, name).sharded_over:
                # Expert weights: the all-to-all backward already summed the ep ranks' gradients;
                # add those of the ranks holding the same experts, divide by the data-parallel size.
                self.mesh.comm("edp").all_reduce(p.grad).div_(self.mesh.size("dp_cp"))
            else:
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

    def named_parameters(self, all_params: bool = False):
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad or all_params]

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
        by_copies: dict[int, list[torch.Tensor]] = {}
        for name, p in self.named_parameters():
            if p.grad is not None:
                pl = get_placement(p, name)
                by_copies.setdefault(replicas(pl, self.mesh), []).append(pl.valid(p.grad.detach()))
        sq = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for copies, grads in by_copies.items():  # one fused (foreach) norm per group
            sq += torch.nn.utils.get_total_norm(grads).double().square().to(sq.device) / copies
        if self.mesh.world_size > 1:
            self.mesh.comm("world").all_reduce(sq)
        return sq.sqrt()

    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank holds (engines with flat buffers return those)."""
        return [p.grad for p in self.parameters() if p.grad is not None]

    def clip_grads(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / global norm); returns the norm."""
        norm = self.grad_norm()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            if float(coef) < 1.0:
                for g in self.grads():
                    g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return float(norm)

    # -- checkpoints (global coordinates) ----------------------------------------------------
    def full_state(self, optimizer, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Global tensors ``model.<global name>`` and ``optim.<global name>.<state>``, assembled
        on rank 0 from every rank's shards (empty on the other ranks unless ``everywhere``).
        Collective."""
        items = []
        for name, p in self.named_parameters(all_params=True):
            pl = get_placement(p, name)
            items.append((f"model.{pl.name}", pl, p))
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):
                    vpl = pl if v.shape == p.shape else Placement(f"{pl.name}.{k}", tuple(v.shape))
                    items.append((f"optim.{pl.name}.{k}", vpl, v))
        return gather_global(items, self.mesh, everywhere)

    def load_full_state(self, state: dict[str, torch.Tensor], optimizer) -> None:
        """Cut this rank's shards out of global tensors (any saving layout)."""
        with torch.no_grad():
            for name, p in self.named_parameters(all_params=True):
                pl = get_placement(p, name)
                key = f"model.{pl.name}"
                if key not in state:
                    raise RuntimeError(f"checkpoint has no tensor {key} (saved from another model?)")
                p.copy_(local_slice(state[key], pl, p.shape))
                prefix = f"optim.{pl.name}."
                st = {}
                for k, v in state.items():
                    if k.startswith(prefix) and "." not in k[len(prefix):]:
                        sub = k[len(prefix):]
                        part = local_slice(v, pl, p.shape) if v.shape == pl.global_shape and v.dim() > 0 else v
                        # a private copy: the optimizer updates it in place
                        st[sub] = part.to(device=_state_device(v, p), copy=True).contiguous()
                if st:
                    optimizer.state[p] = st


def _state_device(v: torch.Tensor, p: torch.Tensor):
    """Optimizer state lives with its parameter; AdamW's scalar ``step`` stays on the CPU except
    for the fused CUDA kernel, which wants it on the GPU."""
    return p.device if v.dim() > 0 or p.device.type == "cuda" else torch.device("cpu")


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> Engine:
    """Apply the parallelisms the config asks for, in the fixed order of the module doc."""
    p = cfg.parallel
    if p.tp > 1:
        from .parallel import tensor
        tensor.apply(model, mesh, cfg)
    if cfg.model.n_experts > 0:  # EP: experts over ep, batch-wide MoE aux losses over dp_cp
        from .parallel import expert
        model = expert.apply(model, mesh, cfg)
    cp_shard = None
    if p.cp > 1:  # CP: ring attention; each rank keeps its load-balanced shard of every sequence
        from .parallel import context
        model = context.apply(model, mesh, cfg)
        cp_shard = lambda x, y: context.shard_batch(x, y, mesh)  # noqa: E731
    # Activation checkpointing and compile wrap whole blocks in place (names unchanged).
    from .parallel import checkpointing
    checkpointing.apply(model, p.activation_checkpointing)
    if p.compile:
        for block in model.layers.values():
            block.compile()
    if p.pp > 1:  # after TP/EP/CP; gradients averaged over dp_cp by the base Engine
        from .parallel.pipeline import apply as pipeline
        engine = pipeline(model, mesh, cfg)
    else:  # last: how data-parallel ranks share model state (parallel/data.py, zero.py, fsdp.py)
        from .parallel import data, fsdp, zero
        if p.zero_stage == 3:
            engine = fsdp.apply(model, mesh, cfg)
        elif p.zero_stage in (1, 2):
            engine = zero.apply(model, mesh, cfg)
        elif mesh.size("dp_cp") > 1:
            engine = data.apply(model, mesh, cfg)
        else:
            engine = Engine(model, mesh, cfg)
    engine.shard_batch = cp_shard
    return engine
