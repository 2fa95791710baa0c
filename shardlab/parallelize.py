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
from .distributed.placement import get_placement, replicas
from .distributed.reshard import gather_pieces
from .parallel import state
from .parallel.materialize import materialize, model_init_fn


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

    # -- state in global coordinates (checkpoints: parallel/state.py) ----------------------------
    def replicate_groups(self, pl) -> tuple[str, ...]:
        """Groups over which a parameter with placement ``pl`` is replicated (tp and pp are
        added by ``writes_piece`` when the placement does not shard over them)."""
        return ("edp",) if "ep" in pl.sharded_over else ("dp_cp",)

    def state_pieces(self, optimizer) -> list:
        """This rank's :class:`Piece` s of the model and optimizer state; of identical replicas
        only one rank lists a piece. No communication."""
        return state.param_pieces(self.named_parameters(all_params=True), optimizer, self.mesh,
                                  self.replicate_groups)

    def load_pieces(self, reader, optimizer) -> None:
        """Read exactly this rank's boxes from ``reader`` (any saving layout). No communication."""
        state.load_param_pieces(self.named_parameters(all_params=True), reader, optimizer)

    def full_state(self, optimizer, everywhere: bool = False) -> dict[str, torch.Tensor]:
        """Global tensors ``model.<global name>`` and ``optim.<global name>.<state>`` assembled
        from every rank's pieces, on rank 0 (on every rank with ``everywhere``). Collective;
        holds the whole state: for tests and small models (checkpoints never use it)."""
        return gather_pieces(self.state_pieces(optimizer), self.mesh, everywhere)

    def load_full_state(self, tensors: dict[str, torch.Tensor], optimizer) -> None:
        """Cut this rank's shards out of global tensors (any saving layout)."""
        self.load_pieces(state.DictReader(tensors), optimizer)


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config, init: bool = True) -> Engine:
    """Apply the parallelisms the config asks for, in the fixed order of the module doc.

    ``model`` may be on the meta device (``models.llama.meta_model``): every parallel module
    then works on meta tensors and, once placements are decided, each rank materialises only
    what it owns (parallel/materialize.py; FSDP its flat shards). ``init=False`` skips drawing
    the initial values (a checkpoint is loaded next)."""
    p = cfg.parallel
    init_fn = model_init_fn(cfg.model, cfg.train.seed)

    def own(m):  # materialise this rank's boxes of whatever is still on meta
        return materialize(m, init_fn, mesh.device, init)
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
        engine = pipeline(model, mesh, cfg, materialize=own)
    else:  # last: how data-parallel ranks share model state (parallel/data.py, zero.py, fsdp.py)
        from .parallel import data, fsdp, zero
        if p.zero_stage == 3:
            engine = fsdp.apply(model, mesh, cfg, init_fn=init_fn if init else None)
        else:
            own(model)
            if p.zero_stage in (1, 2):
                engine = zero.apply(model, mesh, cfg)
            elif mesh.size("dp_cp") > 1:
                engine = data.apply(model, mesh, cfg)
            else:
                engine = Engine(model, mesh, cfg)
    engine.shard_batch = cp_shard
    return engine
