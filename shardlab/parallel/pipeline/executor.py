"""The executor (runs any action list) and the PipelineEngine the train loop drives.

Executor, per action of this rank's list (schedule.py):
  RECV_F  receive the stage input (a leaf tensor that will collect its gradient)
  F       run the stage; the last stage computes loss_i * loss_scale / m (mean over micro-batches)
  SEND_F  isend the stage output
  RECV_B  receive the gradient of the stage output
  B       unsplit: backward of the whole stage (input + weight gradients).
          split (ZB-H1, DualPipeV): input gradient only: ``torch.autograd.grad(out, [input] + Z,
          grad)`` where Z are the outputs of the modules owning parameters (recorded in F by
          forward hooks, with their inputs); weights are not touched (autograd skips their branch).
          The graph is retained only if some module's W needs autograd (wgrad.py).
  W       weight gradients from the saved grads of Z, batched per module without autograd
          (Linear: one matmul, wgrad.py); other modules ``backward(z, dz, inputs=module params)``
  SEND_B  isend the input gradient
A boundary between two stages of the same rank (DualPipeV's turn, stage p-1 -> p) has no
message: F hands its output over as the next stage's input, B its input gradient back.
Every compute action is time-stamped (``engine.last_timeline``) for measured timelines.
"""
from __future__ import annotations

from contextlib import nullcontext
import threading
import time
from types import SimpleNamespace

import torch
from torch import nn

from ...distributed import heap
from ...distributed.lanes import Lanes
from ..engine import Engine
from .aux import attach as attach_aux, stage_aux
from .pairs import is_pair, pair
from .schedule import LAYOUT, Action, Schedule, build
from .simulate import check
from .stage import StageLink, check_p2p_order, mark_pipeline_placements, split_model
from .wgrad import direct_input, held_bytes, weight_grads


class PipelineEngine(Engine):
    """Engine over one pipeline rank's stages; gradients of the stage parameters are averaged
    over ``dp_cp`` by the base Engine (plain data parallel on top of the pipeline)."""

    name = "pipeline"

    def __init__(self, model: nn.Module, mesh, cfg, chunks: dict, ranges: list[range], spec=None):
        super().__init__(model, mesh, cfg)
        p = cfg.parallel
        self.pp, self.v, self.schedule_name = p.pp, (2 if p.pp_schedule in LAYOUT else p.pp_virtual), p.pp_schedule
        self.pp_rank = mesh.local_rank("pp")
        self.chunks, self.ranges, self.spec = chunks, ranges, spec
        self.n_stages = self.pp * self.v
        self.layout = Schedule(p.pp_schedule, self.pp, 1, self.v, layout=LAYOUT.get(p.pp_schedule, "loop"))
        self.rank_of = self.layout.rank_of
        # neighbours of every stage id (dualpipe: two paths, 0..p-1 and p..2p-1; schedule.py)
        self.prev = {s: self.layout.prev_stage(s) for s in range(self.n_stages)}
        self.next = {s: self.layout.next_stage(s) for s in range(self.n_stages)}
        self.is_last = any(self.next[s] is None for s in chunks)
        self.link = StageLink(mesh.comm("pp"), activation_shape(cfg), _param_dtype(model), mesh.device,
                              self.n_stages)
        self._schedules: dict = {}
        self.lookahead = 2  # receives posted ahead of the one being waited for (buffers: 3 activations)
        self.last_timeline: list = []
        self.last_pairs: list = []  # last step: (F, B, baton passes at transfers) of each F&B run as lanes
        self.wgrad_peak_bytes = 0  # last step: most bytes held for deferred W (inputs + output grads)
        self._capture: list | None = None
        self._capture_thread = None
        self.pp_overlap = p.pp_overlap  # F&B pairs as lanes (pairs.py)
        owns = lambda mod: any(p.requires_grad for p in mod.parameters(recurse=False))  # noqa: E731
        for mod in model.modules():  # W needs each parameter-owning module's output (split backward)
            if owns(mod):
                mod.register_forward_hook(self._record_output)
        self._owners = {s: {id(mod) for mod in chunk.modules() if owns(mod)} for s, chunk in chunks.items()}

    def _record_output(self, module, args, output):
        if (self._capture is not None and torch.is_tensor(output) and output.requires_grad
                and threading.get_ident() == self._capture_thread):  # not a paired B's recompute
            self._capture.append((module, output, direct_input(module, args)))

    def _recv_key(self, a) -> tuple:
        return self.link.key(a.kind[-1], a.mb, a.stage - 1 if a.kind == "RECV_F" else a.stage + 1)

    def schedule(self, m: int):
        """The checked action lists for m micro-batches (built and simulated once per m)."""
        if m not in self._schedules:
            sched = build(self.schedule_name, self.pp, m, 1 if self.schedule_name in LAYOUT else self.v)
            check(sched)  # refuses a deadlocking or incomplete list with the reason
            check_p2p_order(sched)  # receives in the order of the sends (no tags)
            if self.pp_overlap:
                sched = pair(sched)
                check(sched)
                check_p2p_order(sched)
            self._schedules[m] = sched
        return self._schedules[m]

    # -- the step --------------------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float = 1.0, autocast=None,
                         mark=None) -> torch.Tensor:
        """Run the schedule over the micro-batches. Returns the mean loss over micro-batches on the
        last stage and 0 on the others (``global_loss`` gives every rank the true value).
        ``mark("step")``, when given, is called first (the schedule interleaves the phases).
        With ``parallel.pp_overlap`` every F&B pair (pairs.py) runs as two lanes."""
        if mark:
            mark("step")
        micro_batches = [self._local(x, y) for x, y in micro_batches]  # cp: this rank's sequence shard
        m = len(micro_batches)
        sched = self.schedule(m)
        self._check_batch(micro_batches)
        st = SimpleNamespace(mbs=micro_batches, m=m, scale=loss_scale, autocast=autocast, split=sched.split_bw,
                             inputs={}, outputs={}, out_grads={}, saved_z={}, in_grads={}, losses=[], aux_sum=0.0,
                             held={}, held_now=0)
        self.wgrad_peak_bytes, self.last_pairs = 0, []
        timeline = []
        actions = sched.ranks[self.pp_rank]
        recvs, n_recv, skip = [a for a in actions if a.kind.startswith("RECV")], 0, False
        for i, a in enumerate(actions):
            if skip:  # the B of a pair, run with its F
                skip = False
                continue
            key = (a.mb, a.stage)
            if a.kind.startswith("RECV"):  # also post the next `lookahead` receives ahead of need
                for r in recvs[n_recv:n_recv + 1 + self.lookahead]:
                    self.link.post(r.peer, self._recv_key(r))
                n_recv += 1
            t0 = time.perf_counter()
            if a.kind == "RECV_F":
                st.inputs[key] = self.link.recv(a.peer, self._recv_key(a)).requires_grad_()
            elif a.kind == "RECV_B":
                st.out_grads[key] = self.link.recv(a.peer, self._recv_key(a))
            elif a.kind == "SEND_F":
                self.link.send(st.outputs[key], a.peer)
            elif a.kind == "SEND_B":
                self.link.send(st.in_grads.pop(key), a.peer)
            elif a.kind == "F" and self.pp_overlap and is_pair(actions, i):
                b, spans, lanes = actions[i + 1], {}, Lanes()
                lanes.run(lambda: self._timed(spans, a, self._forward, st),
                          lambda: self._timed(spans, b, self._backward, st))
                timeline += [(a,) + spans[a], (b,) + spans[b]]
                self.last_pairs.append((a, b, lanes.switches))
                skip = True
                continue
            elif a.kind in ("F", "B", "W"):
                {"F": self._forward, "B": self._backward, "W": self._weights}[a.kind](a, st)
            if a.kind in ("F", "B", "W"):
                timeline.append((a, t0, time.perf_counter()))
        self.link.wait_sends()
        self.last_timeline = timeline
        self.sync_grads()
        return self._local_loss(st.losses, st.aux_sum / m, m)

    @staticmethod
    def _timed(spans: dict, a, fn, st) -> None:
        t0 = time.perf_counter()
        fn(a, st)
        spans[a] = (t0, time.perf_counter())

    def _forward(self, a, st) -> None:
        """F: run the stage; the last stage computes loss_i * loss_scale / m."""
        key = (a.mb, a.stage)
        tokens, targets = st.mbs[a.mb]
        x = tokens if self.prev[a.stage] is None else st.inputs[key]  # received, or handed over locally
        self._capture = [] if st.split else None
        self._capture_thread = threading.get_ident()
        with st.autocast() if st.autocast else nullcontext():
            out = self.chunks[a.stage](x, targets if self.next[a.stage] is None else None,
                                       positions=self._positions(tokens))
        if st.split:
            st.saved_z[key], self._capture = self._capture, None
            if {id(mod) for mod, _, _ in st.saved_z[key]} != self._owners[a.stage]:
                raise RuntimeError(f"zb-h1: a parameter-owning module of stage {a.stage} did not return "
                                   "one tensor that requires grad; its weights would get no W; use 1f1b")
        if self.next[a.stage] is None:  # the loss stage (dualpipe: one per direction)
            st.losses.append(out.detach().double())
            out = out * (st.scale / st.m)
        else:
            out, aux = attach_aux(self.chunks[a.stage], out, st.scale / st.m)
            st.aux_sum += aux
        st.outputs[key] = out
        if self.next[a.stage] in self.chunks:  # next stage on this rank
            st.inputs[(a.mb, a.stage + 1)] = out.detach().requires_grad_()

    def _backward(self, a, st) -> None:
        """B: the whole backward, or with a split backward the input gradient only (module doc)."""
        key = (a.mb, a.stage)
        heap.release(self.mesh.device)  # the forwards' freed temporaries (distributed/heap.py)
        out, grad, x = st.outputs.pop(key), st.out_grads.pop(key, None), st.inputs.pop(key, None)
        if not st.split:
            torch.autograd.backward(out, grad)
            if x is not None:
                st.in_grads[key] = x.grad
        else:
            zs = [z for _, z, _ in st.saved_z[key]]
            wrt = ([x] if x is not None else []) + zs
            keep = any(inp is None for _, _, inp in st.saved_z[key])  # an autograd W needs the graph
            grads = torch.autograd.grad(out, wrt, grad, retain_graph=keep, allow_unused=True)
            if x is not None:
                st.in_grads[key], grads = grads[0], grads[1:]
            st.saved_z[key] = [(mod, z if inp is None else None, inp, g)
                               for (mod, z, inp), g in zip(st.saved_z[key], grads)]
            del zs, wrt, grads
            st.held[key] = held_bytes(st.saved_z[key])
            st.held_now += st.held[key]
            self.wgrad_peak_bytes = max(self.wgrad_peak_bytes, st.held_now)
        if self.prev[a.stage] in self.chunks:  # previous stage on this rank
            st.out_grads[(a.mb, a.stage - 1)] = st.in_grads.pop(key)
        del out, grad, x  # nothing may keep this micro-batch's graph alive past W

    def _weights(self, a, st) -> None:
        """W: the weight gradients from the saved output gradients (wgrad.py)."""
        key = (a.mb, a.stage)
        st.held_now -= st.held.pop(key)
        for mod, z, inp, g in st.saved_z.pop(key):
            if g is None:
                continue
            if inp is not None:
                weight_grads(mod, inp, g)
            else:
                params = [p for p in mod.parameters(recurse=False) if p.requires_grad]
                torch.autograd.backward(z, g, inputs=params)
            del z, inp, g

    def _local_loss(self, losses: list, aux: float, m: int) -> torch.Tensor:
        """Sum of this rank's micro-batch losses / m (the mean over micro-batches on the last
        stage; dualpipe: each loss stage holds one direction's half), 0 elsewhere, plus the mean
        aux losses of this rank's earlier stages."""
        if not losses:
            return torch.zeros((), dtype=torch.float64, device=self.mesh.device) + aux
        loss = torch.stack(losses).mean() if len(losses) == m else torch.stack(losses).sum() / m
        return loss + aux

    def gather_timeline(self) -> list:
        """The last step's measured timeline of every pp rank, on every rank (two all-gathers over
        pp): ``[[(Action, start, end), ...] per rank]``, ready for ``analysis.timeline.plot``."""
        comm = self.mesh.comm("pp")
        counts = comm.all_gather(torch.tensor([len(self.last_timeline)], dtype=torch.int64))
        rows = torch.zeros(int(counts.max()), 5, dtype=torch.float64)
        for i, (a, start, end) in enumerate(self.last_timeline):
            rows[i] = torch.tensor(["FBW".index(a.kind), a.mb, a.stage, start, end], dtype=torch.float64)
        every = comm.all_gather(rows.unsqueeze(0))
        return [[(Action("FBW"[int(k)], int(mb), int(st)), s, e) for k, mb, st, s, e in every[r, :int(n)].tolist()]
                for r, n in enumerate(counts.tolist())]

    @torch.no_grad()
    def evaluate(self, micro_batches, autocast=None) -> torch.Tensor:
        """Forward only: micro-batch by micro-batch, this rank's stages of the micro-batch's path in
        ascending order (each waits only for a lower stage, so it cannot deadlock). Between any two
        ranks both sides issue the messages in (micro-batch, stage) order, as issue-order matching
        needs. Mean loss on the last stage, else 0 (dualpipe: half the micro-batches go up)."""
        losses, aux, m = [], 0.0, len(micro_batches)
        micro_batches = [self._local(x, y) for x, y in micro_batches]
        layout = Schedule(self.schedule_name, self.pp, m, self.v, layout=self.layout.layout)
        for j, (tokens, targets) in enumerate(micro_batches):
            out = None
            for s in sorted(set(self.chunks) & set(layout.path(j))):
                prv, nxt = self.prev[s], self.next[s]
                if prv is None:
                    x = tokens
                elif prv in self.chunks:  # DualPipeV's turn: the previous stage is on this rank
                    x = out
                else:
                    x = self.link.recv(self.rank_of(prv), self.link.key("F", j, prv))
                with autocast() if autocast else nullcontext():
                    out = self.chunks[s](x, targets if nxt is None else None, positions=self._positions(tokens))
                if nxt is None:
                    losses.append(out.double())
                else:
                    a = stage_aux(self.chunks[s])
                    aux += float(a) if a is not None else 0.0
                    if nxt not in self.chunks:
                        self.link.send(out, self.rank_of(nxt))
        self.link.wait_sends()
        return self._local_loss(losses, aux / m, m)

    def global_loss(self, local: torch.Tensor) -> float:
        """Only the last stage has the loss (earlier stages: their MoE aux losses, else 0): sum over
        pp, then average over dp_cp."""
        t = local.detach().clone().to(torch.float64)
        self.mesh.comm("pp").all_reduce(t)
        return float(self.mesh.comm("dp_cp").all_reduce(t, op="avg"))

    def _positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions of this rank's tokens, passed to every stage: a middle stage only sees hidden
        states, whose length differs from the tokens' under sequence parallel."""
        cp = self.mesh.size("cp")
        if cp > 1:  # load-balanced causal shard: two non-contiguous blocks (context.py)
            from ..context import positions
            return positions(tokens.shape[1], self.mesh.local_rank("cp"), cp, tokens.device)
        return torch.arange(tokens.shape[1], device=tokens.device)

    def _check_batch(self, micro_batches):
        t, par = self.cfg.train, self.cfg.parallel
        want = (t.global_batch // (par.dp * par.microbatches), t.seq_len // par.cp)  # tokens, before SP
        got = tuple(micro_batches[0][0].shape[:2])
        if got != want:
            raise ValueError(f"pipeline: micro-batch of shape {got} but the stages agreed on {want} "
                             f"(train.global_batch / (dp * parallel.microbatches), train.seq_len / cp); "
                             f"pass micro-batches of that shape")


def activation_shape(cfg) -> tuple[int, int, int]:
    """(micro-batch, local sequence, d_model): what crosses every stage boundary."""
    p, t = cfg.parallel, cfg.train
    seq = t.seq_len // p.cp
    if p.sequence_parallel and p.tp > 1:
        seq //= p.tp
    return (t.global_batch // (p.dp * p.microbatches), seq, cfg.model.d_model)


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def apply(model: nn.Module, mesh, cfg, spec, materialize=None, make_engine=None) -> PipelineEngine:
    """Keep this rank's stages of ``model``, mark their placements, check the schedule, and
    return the engine. Call after TP/EP/CP have transformed the model. ``materialize(model)``
    gives a meta model's kept stages their storage (only this rank's layers are ever drawn).
    ``make_engine``: the engine class (or factory) to build, default PipelineEngine (sharded.py's;
    the package's ``apply`` picks dual_copies.py's for the dualpipe schedule)."""
    p = cfg.parallel
    engine_sched = build(p.pp_schedule, p.pp, p.microbatches, p.pp_virtual)
    check(engine_sched)  # refuse before any step runs
    check_p2p_order(engine_sched)
    dual = engine_sched.layout == "dual"
    model, chunks, ranges = split_model(model, spec, mesh.local_rank("pp"), p.pp, engine_sched.v,
                                        owner=engine_sched.rank_of, dual=dual, split=p.pp_split)
    mark_pipeline_placements(model)
    if materialize is not None:
        materialize(model)
    engine = (make_engine or PipelineEngine)(model, mesh, cfg, chunks, ranges, spec)
    if not p.pp_overlap:  # else paired on first use (engine.schedule)
        engine._schedules[p.microbatches] = engine_sched
    return engine
