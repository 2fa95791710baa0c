"""Calibration: what one layout really holds and how long its step takes, next to the planner's
prediction. ``measure_layout(cfg, nproc)`` / ``measure_layouts`` spawn the ranks and return one
:class:`Measured` per rank (model state, saved activations' peak and mean per micro-batch, step
time, W stash, CUDA's ``max_memory_allocated``, the model's buffers); ``calibrate(layouts)`` adds
``predict``'s row. What is measured and how: docs/planner_calibration.md."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from . import measured_memory as memory


# -- activations held for backward --------------------------------------------------------------
class _Held:
    """What the pack hook returns: a detached alias (no grad_fn, so no reference cycle) whose
    release by autograd (after the node's backward) releases its storage's count."""
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner._release(self.key)


class SavedActivations:
    """Context manager: the saved-tensor bytes of everything run inside it, by storage (module doc).
    ``exclude``: tensors whose storages are not activations (parameters, buffers, flat buffers)."""

    def __init__(self, exclude=()):
        self.skip = {t.untyped_storage()._cdata for t in exclude if torch.is_tensor(t)}
        self.live: dict[int, list] = {}  # storage -> [bytes, saved references alive]
        self.kept: dict[int, tuple] = {}  # op-policy outputs: storage -> (weak reference, bytes)
        self.current = self.peak = self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t):
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip or not st.nbytes():
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [st.nbytes(), 0]
            self.current += entry[0]
            self.total += entry[0]
        entry[1] += 1
        self.peak = max(self.peak, self.current + self._kept_live())
        return _Held(t.detach(), key, self)

    def keep(self, t):
        """An output the ``op`` recomputation policy keeps (recompute.observe_kept): held outside
        autograd's saved tensors until its block's recomputation; counted while alive."""
        from torch.multiprocessing.reductions import StorageWeakRef
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip or key in self.kept or not st.nbytes():
            return
        self.kept[key] = (StorageWeakRef(st), st.nbytes())
        if key not in self.live:
            self.total += st.nbytes()
        self.peak = max(self.peak, self.current + self._kept_live())

    def _kept_live(self) -> int:
        return sum(n for k, (ref, n) in self.kept.items() if k not in self.live and not ref.expired())

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, _Held) else x

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def model_state_tensors(engine) -> list:
    """Tensors whose storages are model state: parameters and buffers of the rank's model and the
    engine's flat buffers (ZeRO shards, FSDP's gathered ``full``)."""
    out = list(engine.model.parameters()) + list(engine.model.buffers())
    for f in getattr(engine, "flats", []):
        out += [getattr(f, "shard", None), getattr(f, "full", None)]
    return out


# -- the measured run -----------------------------------------------------------------------------
@dataclass
class Measured:
    """One rank's measurement (bytes are floats to match the prediction's fields)."""
    rank: int
    stage: int
    params: float
    grads: float
    optim: float
    act_peak: float
    act_micro: float
    step_s: float
    step_times: list = field(default_factory=list)
    max_alloc: float | None = None
    buffers: float = 0.0
    wgrad_peak: float = 0.0
    """Split-backward pipelines: the engine's peak bytes held for deferred W (``wgrad_peak_bytes``)."""

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optim


def _batches(cfg, mesh):
    from ..models.spec import sample_batch
    topo, c = mesh.topology, mesh.coords
    dp_rank = c["dp_replicate"] * topo.dp_shard + c["dp_shard"]
    m = cfg.parallel.microbatches
    b = max(1, cfg.train.global_batch // topo.size("dp") // m)
    g = torch.Generator().manual_seed(cfg.train.seed + dp_rank)
    return [tuple(t.to(mesh.device) for t in sample_batch(cfg, b, g)) for _ in range(m)]


def _worker(ctx, cfg, warmup: int, steps: int):
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    from ..models.spec import add_adapters, meta_model
    from ..parallelize import parallelize
    from ..train.optim import autocast_factory, build_adamw, param_dtype

    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device, transport=cfg.parallel.comm_transport,
                      comm_thread=cfg.parallel.comm_thread)
    torch.manual_seed(cfg.train.seed)
    model = meta_model(cfg.model, dtype=param_dtype(cfg.train.precision))
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    engine = parallelize(model, mesh, cfg)
    opt = engine.make_optimizer(build_adamw(cfg.train, mesh.device))
    autocast = autocast_factory(cfg.train.precision, mesh.device)
    micro = _batches(cfg, mesh)
    cuda = mesh.device.type == "cuda"

    def step(after_opt=None):
        engine.forward_backward(micro, 1.0, autocast)
        if cfg.train.grad_clip > 0:
            engine.clip_grads(cfg.train.grad_clip)
        opt.step()
        if after_opt:
            after_opt()
        opt.zero_grad(set_to_none=True)

    state = []
    step(lambda: state.append(memory.measure(engine, opt)))
    for _ in range(max(0, warmup - 1)):
        step()
    if cuda:
        torch.cuda.synchronize(mesh.device)
        torch.cuda.reset_peak_memory_stats(mesh.device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(mesh.device)
        times.append(time.perf_counter() - t0)
    max_alloc = float(torch.cuda.max_memory_allocated(mesh.device)) if cuda else None
    from ..parallel.recompute import observe_kept
    with SavedActivations(model_state_tensors(engine)) as acts, observe_kept(acts.keep):
        engine.forward_backward(micro, 1.0, autocast)
    opt.zero_grad(set_to_none=True)
    s = state[0]
    return Measured(mesh.rank, mesh.coords["pp"], float(s.params), float(s.grads), float(s.optim),
                    float(acts.peak), acts.total / cfg.parallel.microbatches,
                    statistics.median(times) if times else float("nan"), times, max_alloc, _buffer_bytes(engine),
                    float(getattr(engine, "wgrad_peak_bytes", 0) or 0))


def _buffer_bytes(engine) -> float:
    """Bytes of the model's buffers (rotary tables, ...), each storage once, parameters' excluded."""
    params = {p.untyped_storage()._cdata for p in engine.model.parameters()}
    seen = {b.untyped_storage()._cdata: b.untyped_storage().nbytes() for b in engine.model.buffers()}
    return float(sum(n for k, n in seen.items() if k not in params))


def measure_layout(cfg, nproc: int, warmup: int = 2, steps: int = 5, device: str = "cpu",
                   timeout_s: float = 300.0) -> list[Measured]:
    """Spawn ``nproc`` ranks of ``cfg`` and return their measurements in rank order."""
    from ..launch import run
    return run(_worker, nproc, cfg, warmup, steps, device=device, threads=1, timeout_s=timeout_s)


def _many_worker(ctx, cfgs, warmup: int, steps: int):
    return [_worker(ctx, cfg, warmup, steps) for cfg in cfgs]


def measure_layouts(cfgs, nproc: int, warmup: int = 1, steps: int = 0, device: str = "cpu",
                    timeout_s: float = 300.0) -> list[list[Measured]]:
    """Several configs on the same ``nproc`` ranks in one spawn (tests): per config, the ranks'
    measurements in rank order."""
    from ..launch import run
    out = run(_many_worker, nproc, list(cfgs), warmup, steps, device=device, threads=1, timeout_s=timeout_s)
    return [[per_rank[i] for per_rank in out] for i in range(len(cfgs))]


# -- prediction next to measurement ---------------------------------------------------------------
def _predict(cfg, device: str, probe):
    try:
        from .predict import predict
    except ImportError:
        return None
    return predict(cfg, device=device, probe=probe)


def rel_err(pred: float | None, meas: float) -> float | None:
    """(pred - meas) / meas, None without a prediction; 0 when both are 0."""
    if pred is None:
        return None
    if meas == 0:
        return 0.0 if pred == 0 else float("inf")
    return (pred - meas) / meas


def compare(name: str, cfg, measured: list[Measured], pred) -> dict:
    """One row: per rank, predicted vs measured model state (exact?), activations and step time."""
    ranks = []
    for m in measured:
        p = pred.ranks[m.rank] if pred is not None else None
        ps = None if p is None else (p.params, p.grads, p.optim)
        ranks.append({"rank": m.rank, "stage": m.stage, "meas": m, "pred": p,
                      "state_exact": None if p is None else ps == (m.params, m.grads, m.optim),
                      "act_err": None if p is None else rel_err(p.activations, m.act_peak),
                      "wgrad_err": None if p is None or not m.wgrad_peak else rel_err(p.wgrad, m.wgrad_peak),
                      "alloc_err": None if p is None or m.max_alloc is None else rel_err(p.total, m.max_alloc)})
    step_s = max(m.step_s for m in measured)
    pred_step = getattr(pred, "step_time_s", None)
    errs = [r["act_err"] for r in ranks if r["act_err"] is not None]
    exact = [r["state_exact"] for r in ranks if r["state_exact"] is not None]
    return {"layout": name, "nproc": len(measured), "cfg": cfg, "ranks": ranks, "step_s": step_s,
            "pred_step_s": pred_step, "step_err": rel_err(pred_step, step_s),
            "state_exact": all(exact) if exact else None,
            "act_err_max": max(errs, key=abs) if errs else None}


def calibrate(layouts, device: str = "cpu", probe=None, warmup: int = 2, steps: int = 5, log=None,
              pred_device: str | None = None) -> list[dict]:
    """``layouts``: (name, nproc, cfg) triples, run one at a time on ``device`` (cpu, cuda) and
    predicted for ``pred_device`` (the planner's kind: cpu, h100, h200, ...; default ``device``).
    Returns one :func:`compare` row each (a layout whose ranks fail gives a row with ``error``)."""
    from ..launch import WorkerError
    rows = []
    for name, nproc, cfg in layouts:
        t0 = time.time()
        try:
            measured = measure_layout(cfg, nproc, warmup, steps, device)
        except WorkerError as e:
            rows.append({"layout": name, "nproc": nproc, "error": str(e).strip().splitlines()[0][:160]})
            continue
        try:
            pred, pred_error = _predict(cfg, pred_device or device, probe), ""
        except Exception as e:  # noqa: BLE001 - a planner failure is a finding, the measurement stays
            pred, pred_error = None, f"predict failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        row = compare(name, cfg, measured, pred)
        row["pred_error"] = pred_error
        row["seconds"] = time.time() - t0
        rows.append(row)
        if log:
            log(row)
    return rows
