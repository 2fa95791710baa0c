"""Training with live recovery of data-parallel replicas (``train.fault_tolerance = "replica"``).

``train_replica(ctx, data_dir)`` runs on every rank of every replica group (started by
``launch_replicas.run``; ``ctx.plan``: the run plan). A replica is ``world / dp_replicate``
ranks holding the rest of the layout in its own torch.distributed world. Per step: a quorum of
the live replicas (distributed/quorum.py), a heal of any member behind (state sent from a peer,
crc32-checked), forward/backward on this replica's shard, gradients averaged over the live
replicas, a vote on the state's fingerprint, then the optimizer step on commit. How, and what a
degraded step, evaluation, checkpoints and ``--resume`` mean: docs/faults.md, "Live recovery"."""
from __future__ import annotations

import copy
import json
import math
import os
import signal
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..distributed import quorum
from ..distributed.mesh import Mesh
from ..distributed.topology import Topology
from ..models.spec import get_spec
from ..checkpoint.format import tensor_bytes
from ..checkpoint import save as ckpt
from .data import Loader
from .loop import Trainer, open_data  # at import: a warm spare process has paid for it before a failure
from .metrics import MetricsWriter
from .optim import lr_at, schedule_steps


@dataclass
class FTContext:
    """Where a rank sits among the replica groups (``launch_replicas`` makes one per rank)."""

    replica: int
    """This rank's replica group, 0 .. n_replicas - 1."""
    gen: int
    """How many times this replica slot was started before (0 = the first start)."""
    n_replicas: int
    """R = ``parallel.dp_replicate`` of the whole job."""
    store_port: int
    """Port of the launcher's TCPStore (127.0.0.1)."""
    timeout_s: float
    """``train.ft_timeout_s``: cross-replica collective and vote timeout."""
    faults: dict = field(default_factory=dict)
    """TEST-ONLY injected faults (tests/distributed/test_live_recovery.py): ``kill``: [[replica, gen,
    local, step, sigkill|raise]]; ``corrupt_once``: a flag file: the first heal sent before it exists
    has a flipped byte; ``hold_start``: [[replica, gen, seconds]]: that start waits before it joins."""


def replica_config(cfg: Config) -> Config:
    """The layout one replica runs: ``dp_replicate`` 1, ``global_batch / dp_replicate``."""
    p, t = cfg.parallel, cfg.train
    out = copy.deepcopy(cfg)
    out.parallel.dp_replicate, out.train.global_batch = 1, t.global_batch // p.dp_replicate
    out.parallel.comm_transport = "process_group"  # no shared-memory arenas left by a killed rank
    return out


def check(cfg: Config) -> None:
    """ConfigError (one line naming the field) for jobs live recovery cannot run."""
    p, t = cfg.parallel, cfg.train
    if p.dp_replicate < 2:
        raise ConfigError("train.fault_tolerance", f"replica recovery needs parallel.dp_replicate >= 2 replica "
                                                   f"groups, got {p.dp_replicate}; set --parallel.dp_replicate=2")
    if t.global_batch % p.dp_replicate:
        raise ConfigError("train.global_batch", f"{t.global_batch} is not divisible by dp_replicate = "
                                                f"{p.dp_replicate} (each replica trains its share)")
    if t.precision == "fp16":
        raise ConfigError("train.precision", "fp16's dynamic loss scaler is not agreed across replicas in replica "
                                             "recovery; use --train.precision=bf16 or fp32 with "
                                             "train.fault_tolerance=replica")
    if get_spec(cfg.model).task == "classify":
        raise ConfigError("train.fault_tolerance", "replica recovery trains language models only (this model is an "
                                                   "image classifier); set --train.fault_tolerance=off")


def local_tensors(engine, optimizer) -> list[torch.Tensor]:
    """Everything that makes this rank's state, in an order that is the same on every replica
    (same layout): model parameters and buffers, the optimizer's parameters, its state tensors."""
    out = [p.data for _, p in engine.model.named_parameters()] + [b for _, b in engine.model.named_buffers()]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out += [p.data for p in params]
    for p in params:
        st = optimizer.state.get(p, {})
        out += [st[k] for k in sorted(st) if torch.is_tensor(st[k])]
    return [t for t in out if t.numel()]


def optim_manifest(optimizer) -> list:
    """[param index, state key, shape, dtype, device type] of every optimizer state tensor."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [[i, k, list(v.shape), str(v.dtype).replace("torch.", ""), v.device.type]
            for i, p in enumerate(params) for k, v in sorted(optimizer.state.get(p, {}).items()) if torch.is_tensor(v)]


def ensure_optim_state(optimizer, manifest: list) -> None:
    """Create (zeros) the optimizer state tensors of ``manifest`` that this optimizer does not
    have yet (a replacement before its first step: AdamW creates its state lazily)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, k, shape, dtype, dev in manifest:
        st = optimizer.state.setdefault(params[i], {})
        if k not in st:
            st[k] = torch.zeros(shape, dtype=getattr(torch, dtype), device=params[i].device if dev != "cpu" else "cpu")


def fingerprint(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(tensor_bytes(t.detach().cpu()), crc)
    return crc & 0xFFFFFFFF


class _Replica:
    """One rank's training state and its side of the protocol. Built before the rank knows its
    replica (a hot spare, ``launch_replicas``); :meth:`run` takes the assignment."""

    def __init__(self, ctx, data_dir: str):
        self.plan, self.cfg, self.t = ctx.plan, ctx.plan.config, ctx.plan.config.train
        cfg, rcfg = self.cfg, replica_config(self.cfg)
        self.mesh = Mesh.build(Topology.from_config(rcfg.parallel), ctx.device, transport=self.plan.transport)
        data = open_data(cfg, data_dir)
        self.tr = Trainer(rcfg, self.mesh, data)
        R, dp_in = cfg.parallel.dp_replicate, self.mesh.topology.size("dp")
        self.loaders = [Loader(data, self.t.seq_len, self.t.global_batch, cfg.parallel.microbatches,  # shard r of
                               r * dp_in + self.mesh.coords["dp_shard"], R * dp_in, self.t.seed, ctx.device)  # a batch
                        for r in range(R)]
        self.val = [mb for b in zip(*(ld.val_batches(self.t.eval_batches) for ld in self.loaders))
                    for mb in b]  # batch-major: the shards of all replicas, every batch
        self.counts = {"steps": 0, "degraded": 0, "aborted": 0, "healed": 0, "refused": 0}

    def _assign(self, ft: FTContext) -> None:
        cfg, self.ft = self.cfg, ft
        self.tr.loader = self.loaders[ft.replica]
        self.resumed = self.plan.resume_from if ft.gen == 0 else None  # a replacement heals from a peer
        if self.resumed is not None:
            self.tr.load_checkpoint(self.resumed)
        for r, gen, seconds in ft.faults.get("hold_start", []):  # TEST-ONLY: a slow or stuck start
            if (r, gen) == (ft.replica, ft.gen):
                time.sleep(seconds)
        self.member = quorum.Member(ft.store_port, ft.replica, ft.gen, self.mesh.rank, self.mesh.world_size, ft.timeout_s)
        self.writer = None
        if self.mesh.rank == 0:
            self.writer = MetricsWriter(Path(cfg.logging.run_dir) / f"replica_{ft.replica}", False)

    # -- healing ---------------------------------------------------------------------------
    def _meta(self) -> bytes:
        tr = self.tr
        return json.dumps({"step": tr.step, "data": tr.loader.state_dict(), "scaler": tr.scaler.state_dict(),
                           "optim": optim_manifest(tr.optimizer)}).encode()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return local_tensors(self.tr.engine, self.tr.optimizer)

    def _send(self, pg, to: int) -> None:
        payload = torch.cat([torch.frombuffer(bytearray(tensor_bytes(t.detach().cpu())), dtype=torch.uint8)
                             for t in self.tensors + [torch.get_rng_state()]])
        meta = torch.frombuffer(bytearray(self._meta()), dtype=torch.uint8)
        crc = zlib.crc32(meta.numpy(), zlib.crc32(payload.numpy())) & 0xFFFFFFFF
        flag = self.ft.faults.get("corrupt_once")
        if flag and not os.path.exists(flag):  # TEST-ONLY: one damaged transfer
            open(flag, "w").close()
            payload[payload.numel() // 2] ^= 0x55
        quorum.wait(pg.send([torch.tensor([payload.numel(), meta.numel(), crc], dtype=torch.int64)], to, 0))
        quorum.wait(pg.send([meta], to, 1))
        quorum.wait(pg.send([payload], to, 2))

    def _receive(self, pg, src: int) -> tuple[torch.Tensor, dict]:
        head = torch.zeros(3, dtype=torch.int64)
        quorum.wait(pg.recv([head], src, 0))
        n, m, crc = (int(x) for x in head)
        payload, meta = torch.empty(n, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)
        quorum.wait(pg.recv([meta], src, 1))
        quorum.wait(pg.recv([payload], src, 2))
        got = zlib.crc32(meta.numpy(), zlib.crc32(payload.numpy())) & 0xFFFFFFFF
        if got != crc:
            self.counts["refused"] += 1
            raise quorum.QuorumFailed(f"heal: checksum mismatch (crc32 {got:08x}, sender says {crc:08x}): "
                                      "state refused, asking again")
        state = json.loads(bytes(meta.numpy()))
        params = [p for g in self.tr.optimizer.param_groups for p in g["params"]]
        have = sum(t.numel() * t.element_size() for t in self.tensors + [torch.get_rng_state()])
        missing = sum(math.prod(shape) * getattr(torch, dtype).itemsize for i, k, shape, dtype, _ in state["optim"]
                      if k not in self.tr.optimizer.state.get(params[i], {}))
        if n != have + missing:
            raise quorum.QuorumFailed(f"heal: {n} bytes offered, this layout holds {have + missing}")
        return payload, state

    def _apply(self, payload: torch.Tensor, state: dict) -> None:
        """Copy a verified heal into this rank's state -- only once every rank's heal of the
        quorum is committed, so that the ranks of a replica never disagree on what they hold."""
        ensure_optim_state(self.tr.optimizer, state["optim"])
        tensors = self.tensors
        sizes = [t.numel() * t.element_size() for t in tensors + [torch.get_rng_state()]]
        pos = 0
        with torch.no_grad():
            for t, size in zip(tensors, sizes):
                t.view(-1).view(torch.uint8).copy_(payload[pos:pos + size]) if t.is_contiguous() else \
                    t.copy_(payload[pos:pos + size].view(t.dtype).view(t.shape))
                pos += size
        torch.set_rng_state(payload[pos:].clone())
        self.tr.step = int(state["step"])
        self.tr.loader.load_state_dict(state["data"])
        self.tr.scaler.load_state_dict(state["scaler"])
        self.counts["healed"] += 1

    def heal(self, q: dict) -> bool:
        me, ok, got = str(self.ft.replica), True, None
        try:
            pg = self.member.group(q)
            if me in q["heal"]:
                got = self._receive(pg, q["members"].index(q["heal"][me]))
            for joiner, src in sorted(q["heal"].items()):
                if src == self.ft.replica:
                    self._send(pg, q["members"].index(int(joiner)))
        except quorum.QuorumFailed as e:
            ok = False
            self._say(f"heal in quorum {q['id']} failed: {e}")
        except Exception as e:  # building the group with a dead member, ...
            ok = False
            self._say(f"heal in quorum {q['id']} failed: {type(e).__name__}: {e}")
        committed = self._decided(q, "heal", ok, 0)
        if committed and got is not None:
            self._apply(*got)
        return committed

    # -- one step --------------------------------------------------------------------------
    def step(self, q: dict) -> bool:
        tr, t = self.tr, self.t
        fp = fingerprint(self.tensors)
        try:  # the group's rendezvous now, while the members are in step (they just got the quorum)
            self.member.group(q) if len(q["members"]) > 1 else None
        except Exception as e:
            self._say(f"step {tr.step + 1}: building the quorum's group failed: {type(e).__name__}: {e}")
            self.counts["aborted"] += 1
            self._decided(q, "step", False, fp)
            return False
        cursor = tr.loader.state_dict()
        lr = lr_at(schedule_steps(tr.step, tr.scaler, t), t)
        for g in tr.optimizer.param_groups:
            g["lr"] = lr
        local = tr.engine.forward_backward(tr.loader.next_batch(), 1.0, tr.autocast)
        loss = torch.tensor([tr.engine.global_loss(local)], dtype=torch.float64)
        self._fault(tr.step + 1)
        ok = True
        try:
            quorum.average(q, self.member, tr.engine.grads() + [loss])
        except quorum.QuorumFailed as e:
            ok = False
            self._say(f"step {tr.step + 1}: cross-replica average failed: {e}")
        committed = self._decided(q, "step", ok, fp)
        if committed:
            gnorm = tr.engine.clip_grads(t.grad_clip)
            if math.isfinite(gnorm):
                tr.optimizer.step()
            tr.step += 1
            self.counts["steps"] += 1
            live = len(q["members"])
            self.counts["degraded"] += live < self.ft.n_replicas
            if self.writer and (tr.step % self.cfg.logging.log_every == 0 or live < self.ft.n_replicas
                                or tr.step == t.steps):
                self.writer.write({"kind": "train", "step": tr.step, "loss": float(loss), "lr": lr,
                                   "grad_norm": gnorm, "live_replicas": live, "members": q["members"],
                                   "replicas": self.ft.n_replicas,
                                   "effective_batch": t.global_batch * live // self.ft.n_replicas,
                                   "degraded": live < self.ft.n_replicas, "replica": self.ft.replica,
                                   "gen": self.ft.gen, "fingerprint": fp, "time": time.time()})
        else:
            tr.loader.load_state_dict(cursor)
            self.counts["aborted"] += 1
        tr.optimizer.zero_grad(set_to_none=True)
        if committed:
            self._after(q)
        return committed

    def _after(self, q: dict) -> None:
        """Evaluation (every member) and checkpoint (the lowest member) after a committed step."""
        tr, t, step = self.tr, self.t, self.tr.step
        if (t.eval_every and step % t.eval_every == 0) or step == q["last"]:
            val = tr.evaluate(self.val)
            if self.writer and self.ft.replica == q["members"][0]:
                self.writer.write({"kind": "val", "step": step, "val_loss": val, "replica": self.ft.replica,
                                   "live_replicas": len(q["members"])})
        every = self.cfg.checkpoint.every
        if self.cfg.checkpoint.save and self.ft.replica == q["members"][0] and \
                ((every and step % every == 0) or step == q["last"]):
            tr.save_checkpoint(self.plan.checkpoint_dir, self.plan.test_hooks)

    def _decided(self, q: dict, phase: str, ok: bool, fp: int) -> bool:
        decision = self.member.vote(q, phase, ok, fp)
        if decision.startswith("diverged"):
            raise quorum.Diverged(f"replica {self.ft.replica} at step {self.tr.step}: fingerprints of the "
                                  f"replicas differ ({decision}); the run stops rather than train on diverged state")
        if decision != "commit":
            self.member.drop_group()
        return decision == "commit"

    def _fault(self, step: int) -> None:
        """TEST-ONLY: the faults of ``FTContext.faults`` (a no-op otherwise)."""
        for r, gen, local, at, how in self.ft.faults.get("kill", []):
            if (r, gen, local, at) == (self.ft.replica, self.ft.gen, self.mesh.rank, step):
                if how == "raise":
                    raise RuntimeError(f"injected failure of replica {r} at step {step}")
                os.kill(os.getpid(), signal.SIGKILL)

    def _say(self, msg: str) -> None:
        if self.mesh.rank == 0:
            print(f"shardlab: replica {self.ft.replica} (gen {self.ft.gen}): {msg}", flush=True)

    def run(self, ft: FTContext) -> dict:
        """Train as replica ``ft.replica`` until the lighthouse says done; the final state."""
        t = self.t
        self._assign(ft)
        try:
            while True:
                q = self.member.quorum(self.tr.step, t.steps)
                if q["done"]:
                    break
                if q["heal"] and not self.heal(q):
                    continue
                if self.tr.step < q["last"]:
                    self.step(q)
            ckpt.finish_saves(self.mesh)  # an asynchronous save in flight: wait, raise if it failed
        finally:
            self.member.close()  # the heartbeat stops with the training thread, on every way out
            if self.writer:
                self.writer.close()
        return {"resumed_from": str(self.resumed) if self.resumed else None, "replica": self.ft.replica, "gen": self.ft.gen, "local": self.mesh.rank, "step": self.tr.step,
                "fingerprint": fingerprint(self.tensors), **self.counts,
                "params": {n: p.detach().clone() for n, p in self.tr.engine.model.named_parameters()}}


def train_replica(ctx, data_dir: str) -> _Replica:
    """Every rank of every replica group (module doc), in two halves: this builds the engine and
    the data (a hot spare, before its replica is known); ``.run(ft)`` trains as replica ``ft``."""
    return _Replica(ctx, data_dir)
