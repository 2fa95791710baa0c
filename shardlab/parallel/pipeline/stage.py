"""Cut a model into pipeline stages and move activations between neighbours.

Partition. ``pp * v`` stages, each a contiguous run of layers (at least one), chosen to
minimise the largest stage parameter count (exact dynamic programme); stage 0 also counts the
embedding, the last stage the final norm and the output head (and computes the loss). Uneven
layer counts are allowed. With ``parallel.pp_split = ends`` (Llama 3's layout) the first stage
holds only the embedding and the last only the head (no layer: ``holds_ends``), and the layers
fill the stages between. Stage ``s`` lives on pipeline rank ``s % pp`` (round-robin chunks for
the interleaved schedule).

The rank keeps ONE model module holding all its layers under their global names
(``layers.<i>``), with the modules of the spec's ``pp_first`` (e.g. the embedding) and
``pp_last`` (final norm, head) set to None where it does not own them (the model's forward then
takes and/or returns hidden states: the convention of models/spec.py). Each stage (chunk) is a
light view of that module over its own layers: same parameters, no copies.

Exchange. Activations and their gradients all have one shape, agreed ahead from the config
(micro-batch x local sequence x d_model), so a receiver allocates its buffer without any
per-message handshake. Messages carry no tag: NCCL ignores tags and matches the messages between
two ranks by the order they are issued. Every rank runs its action list in order, so a message
reaches the right receive when, for every (sender, receiver) pair, the sender's SEND actions and
the receiver's RECV actions name the same messages in the same order: :func:`check_p2p_order`
proves that of a schedule before it runs (the engine refuses a schedule that breaks it).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...distributed.placement import ATTR, Placement, get_placement, set_placement


def partition(layer_sizes: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[range]:
    """Split layers 0..L-1 into ``n_stages`` contiguous non-empty runs minimising the largest
    stage size (layer sizes + ``first_extra`` on stage 0 + ``last_extra`` on the last one)."""
    n = len(layer_sizes)
    if n < n_stages:
        raise ValueError(f"{n} layers cannot fill {n_stages} pipeline stages; lower parallel.pp "
                         f"(or pp_virtual) or add layers (model.n_layers)")
    prefix = [0]
    for x in layer_sizes:
        prefix.append(prefix[-1] + x)

    def size(s, i, j):  # stage s holds layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == n_stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]  # best[s][j]: first s stages cover j layers
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for j in range(s, n - (n_stages - s) + 1):
            for i in range(s - 1, j):
                cost = max(best[s - 1][i], size(s - 1, i, j))
                if cost < best[s][j]:
                    best[s][j], cut[s][j] = cost, i
    bounds, j = [], n
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[s][j], j))
        j = cut[s][j]
    return bounds[::-1]


def _numel(mod) -> int:
    return sum(p.numel() for p in mod.parameters()) if mod is not None else 0


def model_partition(model: nn.Module, spec, n_stages: int, split: str = "balanced") -> list[range]:
    """Layer ranges of every stage of ``model``: balanced by parameter count, or (``split`` ends,
    Llama 3's) an empty first stage holding only the embedding, an empty last one holding only
    the head, and the layers balanced over the stages between (``holds_ends``)."""
    sizes = [_numel(model.layers[str(i)]) for i in range(len(model.layers))]
    if split == "ends":
        n = len(sizes)
        return [range(0, 0)] + partition(sizes, n_stages - 2) + [range(n, n)]
    first = sum(_numel(getattr(model, n)) for n in spec.pp_first)
    last = sum(_numel(getattr(model, n)) for n in spec.pp_last)
    return partition(sizes, n_stages, first, last)


def holds_ends(ranges: list[range], stage: int) -> tuple[bool, bool]:
    """(embedding, head): whether ``stage`` holds the model's first modules and its last ones.
    The stage starting at layer 0 holds the embedding, the one ending at the last layer the head;
    where the split gives them stages of their own (empty ranges at either end), only those."""
    end = max(r.stop for r in ranges)
    r = ranges[stage]
    own_first = any(x.start == x.stop == 0 for x in ranges)
    own_last = any(x.start == x.stop == end for x in ranges)
    return (r.start == 0 and (r.stop == 0 or not own_first),
            r.stop == end and (r.start == end or not own_last))


def _view(model: nn.Module, spec, layers: range, first: bool, last: bool) -> nn.Module:
    """An instance of the model's class sharing ``model``'s modules for one stage (its __init__
    would build new ones): its own layers, the first/last stage's modules or None."""
    chunk = type(model).__new__(type(model))
    nn.Module.__init__(chunk)
    for key, value in vars(model).items():  # plain attributes (e.g. cfg)
        if not key.startswith("_") and key != "training":
            object.__setattr__(chunk, key, value)
    for key, mod in model._modules.items():
        if key == "layers":
            mod = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        elif key in spec.pp_first and not first or key in spec.pp_last and not last:
            mod = None
        chunk._modules[key] = mod
    return chunk


def stage_views(model: nn.Module, spec, ranges: list[range], stages: list[int]) -> dict[int, nn.Module]:
    """{stage: view} over ``model``'s current modules (call again after wrapping blocks). A stage
    starting at layer 0 holds the embedding, one ending at the last layer the head, or the empty
    end stages of the ends split (``holds_ends``; dualpipe: two stage ids per range)."""
    return {s: _view(model, spec, ranges[s], *holds_ends(ranges, s)) for s in stages}


def split_model(model: nn.Module, spec, pp_rank: int, pp: int, v: int = 1, owner=None, dual: bool = False,
                split: str = "balanced"):
    """Keep only this rank's parts of ``model`` (in place). Returns (the rank's module with
    global names, {stage: chunk view}, the layer ranges of all stages). ``owner(stage)``: the
    rank of a stage (default round-robin ``stage % pp``; DualPipeV's V: schedule.rank_of).
    ``dual`` (DualPipe): the model is cut into ``pp`` parts and stage ids ``pp + k`` run part
    ``k`` again (the second direction), so ranks r and pp-1-r both hold parts r and pp-1-r.
    ``split``: model_partition's."""
    n_stages = pp * v
    ranges = model_partition(model, spec, pp if dual else n_stages, split)
    if dual:
        ranges = ranges + ranges
    owner = owner or (lambda s: s % pp)
    mine = [s for s in range(n_stages) if owner(s) == pp_rank]
    keep = {str(i) for s in mine for i in ranges[s]}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    owns_first = any(holds_ends(ranges, s)[0] for s in mine)
    owns_last = any(holds_ends(ranges, s)[1] for s in mine)
    chunks = stage_views(model, spec, ranges, mine)
    for name in (() if owns_first else spec.pp_first) + (() if owns_last else spec.pp_last):
        setattr(model, name, None)
    return model, chunks, ranges


def mark_pipeline_placements(model: nn.Module) -> None:
    """Every parameter of a stage exists on one pipeline rank only: add "pp" to its placement
    (after any TP placement), so the global gradient norm counts each element once."""
    for name, p in model.named_parameters():
        pl = getattr(p, ATTR, None) or Placement(name, tuple(p.shape))
        if "pp" not in pl.sharded_over:
            set_placement(p, replace(pl, sharded_over=tuple(pl.sharded_over) + ("pp",)))
    assert all("pp" in get_placement(p, n).sharded_over for n, p in model.named_parameters())


def check_p2p_order(sched) -> None:
    """Raise unless, for every pair of pipeline ranks (a -> b), the SEND actions of a to b and the
    RECV actions of b from a name the same messages (kind, micro-batch, sending stage) in the
    same order: point-to-point messages are matched by issue order, never by tag."""
    for a, actions in enumerate(sched.ranks):
        for b in range(len(sched.ranks)):
            sent = [(x.kind[-1], x.mb, x.stage) for x in actions if x.kind.startswith("SEND") and x.peer == b]
            got = [(x.kind[-1], x.mb, sched.prev_stage(x.stage) if x.kind == "RECV_F" else sched.next_stage(x.stage))
                   for x in sched.ranks[b] if x.kind.startswith("RECV") and x.peer == a]
            if sent != got:
                i = next((i for i, (u, w) in enumerate(zip(sent, got)) if u != w), min(len(sent), len(got)))
                raise RuntimeError(f"pipeline schedule {sched.name}: rank {a} sends rank {b} the messages "
                                   f"{sent[i:i + 3]}... but rank {b} receives {got[i:i + 3]}... at position {i}; "
                                   "messages are matched by issue order (NCCL ignores tags): the receives "
                                   "must come in the order of the sends")


class StageLink:
    """Point-to-point exchange over the ``pp`` group with shapes agreed ahead.

    ``send`` never blocks (isend; the step waits for all sends at its end); ``recv`` blocks until
    the tensor arrived. ``post`` issues a receive early (irecv into a fresh buffer) so that the
    transfer overlaps compute; ``recv`` then only waits for it. ``key(kind, mb, stage)`` names a
    message by its sending stage, only to find a posted receive again: what arrives in a receive
    is decided by issue order alone (see the module docstring)."""

    def __init__(self, comm, shape: tuple, dtype: torch.dtype, device, n_stages: int):
        self.comm, self.shape, self.dtype, self.device = comm, tuple(shape), dtype, device
        self.n_stages = n_stages
        self.pending: list = []
        self.posted: dict = {}

    @staticmethod
    def key(kind: str, mb: int, src_stage: int) -> tuple:
        return kind, mb, src_stage

    def send(self, t: torch.Tensor, peer: int) -> None:
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"pipeline: stage output of shape {tuple(t.shape)} {t.dtype} differs from the "
                               f"agreed {self.shape} {self.dtype} (micro-batch x sequence x d_model)")
        t = t.detach().contiguous()
        self.pending.append((self.comm.isend(t, peer), t))

    def post(self, peer: int, key: tuple) -> None:
        if key not in self.posted:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.posted[key] = (self.comm.irecv(buf, peer), buf)

    def recv(self, peer: int, key: tuple) -> torch.Tensor:
        self.post(peer, key)
        work, buf = self.posted.pop(key)
        work.wait()
        return buf

    def wait_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
