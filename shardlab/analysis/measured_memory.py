"""Model-state memory per rank (``shardlab memory``): the ZeRO formula (ZeRO paper, Rajbhandari et
al. 2020) for DDP and ZeRO-1/2/3 next to what one real step holds (every allocated storage counted
once), and the measured run's peak and timeline. The formula, its precisions and LoRA's frozen
base: docs/data-parallel.md, "Memory"; the peak: "Where the memory goes"."""
from __future__ import annotations

from dataclasses import dataclass

import torch

STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8), "fp64": (8, 8, 16)}


@dataclass
class StateBytes:
    params: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim


def formula(psi: int, n: int, stage: int, precision: str = "mixed", trainable: int | None = None) -> StateBytes:
    """Per-rank bytes of model state for ``psi`` parameters over ``n`` data-parallel ranks, of
    which ``trainable`` (default all) take gradients and optimizer state. Frozen parameters (a LoRA
    base) stay whole on every rank under every stage; only trainable ones are sharded."""
    p, g, k = PRECISIONS[precision]
    t = psi if trainable is None else trainable
    return StateBytes((psi - t) * p + t * p / (n if stage >= 3 else 1), t * g / (n if stage >= 2 else 1),
                      t * k / (n if stage >= 1 else 1))


def activation_estimate(cfg, micro_batch: int, bytes_per_elem: int = 2) -> float:
    """Activations kept for backward, per rank and micro-batch (Korthikanti et al. 2022, no
    recomputation, no TP/SP): per layer s*b*h*(34 + 5*a*s/h) bytes at 2 bytes/element, plus
    the logits (s*b*V, kept twice: logits and softmax). An estimate, not a measurement."""
    m, s, b = cfg.model, cfg.train.seq_len, micro_batch
    per_layer = s * b * m.d_model * (34 + 5 * m.n_heads * s / m.d_model) * bytes_per_elem / 2
    return m.n_layers * per_layer + 2 * s * b * m.vocab_size * bytes_per_elem


def measure(engine, optimizer) -> StateBytes:
    """Bytes of the storages a rank holds, each storage counted once, in the order params ->
    grads -> optimizer (a gradient that is a view of a bucket counts the bucket once)."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    flats = getattr(engine, "flats", [])
    master = [f.shard for f in flats if f.shard.dtype != getattr(f, "full", f.shard).dtype]
    params = list(engine.model.parameters()) + [f.shard for f in flats if all(f.shard is not m for m in master)] \
        + [getattr(f, "full", None) for f in flats]
    grads = [p.grad for p in params if torch.is_tensor(p)] + [getattr(f, "grad_full", None) for f in flats] \
        + engine.grads()
    optim = master + [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return StateBytes(size(params), size(grads), size(optim))


# -- the measured run (spawned ranks) -------------------------------------------------------------
def _phases(engine, opt, batches, autocast, rec, step: int):
    """One training step with its phases marked (forward, backward, optimizer) and the model state
    measured at each mark, through the engine's own ``forward_backward`` (pipelines, which
    interleave the phases, mark one ``step`` phase before the optimizer)."""
    def mark(phase: str):
        rec.mark(f"{phase} {step}", measure(engine, opt))
    engine.forward_backward(batches, 1.0, autocast, mark=mark)
    mark("optimizer")
    engine.clip_grads(1.0)
    opt.step()


def _warm_up(cfg, device):
    """One step of a one-block copy of the model (the run's widths, vocabulary 64, no
    communication) on the run's micro-batch of tokens, before the baseline is taken: the
    libraries and kernels a step loads, and autograd's and the optimizer's own state, count as the
    empty rank's, not as the model's. The CPU's matmul library picks its kernels, and their memory
    outside torch's allocator, by each matmul's shape. With the warm-up of 2 x 16 tokens at d_model
    32 used before 2026-12-07 that memory counted as the model's: the first pipeline stage of
    tests/distributed/test_memory_peaks.py's bf16 loss model measured 86-88 MiB on an AVX-512 bf16
    CPU (EPYC) and 81 with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA), the same torch allocations
    (profiled: 59.5 MiB) in both, against 77 predicted; with this one it measures 77 in both."""
    from dataclasses import replace
    from ..models.spec import get_spec
    from ..train.optim import autocast_factory, build_adamw
    from .plan_activations import micro_batch
    if get_spec(cfg.model).task != "lm":
        return
    seq = max(16, cfg.train.seq_len // cfg.parallel.cp)
    tiny = replace(cfg.model, n_layers=1, vocab_size=64, max_seq_len=seq)
    model = get_spec(tiny).build(tiny).to(device)
    opt = build_adamw(cfg.train, device)(model.parameters())
    x = torch.randint(0, 64, (micro_batch(cfg), seq), device=device)
    autocast = autocast_factory(cfg.train.precision, device)
    from contextlib import nullcontext
    with autocast() if autocast else nullcontext():
        loss = model(x, x)
    loss.backward()
    opt.step()
    del model, opt, loss
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the run's reserved bytes are its own


def _measure_worker(ctx, cfg, steps: int = 2, cuda_snapshot: str = "", categories: bool = False):
    from ..distributed.mesh import Mesh
    from ..distributed.topology import Topology
    from ..models.spec import add_adapters, meta_model, sample_batch
    from ..parallelize import parallelize
    from ..train.optim import autocast_factory, build_adamw
    from .memtrace import Recorder, categories_at_peak, cuda_history, dump_cuda_history, profiled, reset_peak_rss
    from .plan_activations import micro_batch

    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device, transport=cfg.parallel.comm_transport,
                      comm_thread=cfg.parallel.comm_thread)
    _warm_up(cfg, mesh.device)
    reset_peak_rss()  # the peak read at the end is the run's, not the warm-up's
    rec = Recorder(mesh.device, mesh.rank)  # the empty rank: its baseline is the fixed overhead
    cuda_history(bool(cuda_snapshot))
    with rec:
        model = meta_model(cfg.model, dtype=torch.float32)
        if cfg.train.lora_rank:
            add_adapters(model, cfg.train)
        engine = parallelize(model, mesh, cfg)  # each rank draws its boxes of the initial values
        autocast = autocast_factory(cfg.train.precision, mesh.device)
        opt = engine.make_optimizer(build_adamw(cfg.train, mesh.device))
        b = micro_batch(cfg)
        g = torch.Generator().manual_seed(cfg.train.seed + mesh.rank)
        for step in range(steps):  # the second step holds the optimizer states the first created
            batches = [tuple(t.to(mesh.device) for t in sample_batch(cfg, b, g))
                       for _ in range(cfg.parallel.microbatches)]
            with profiled(categories and step == steps - 1) as prof:  # the last step, by category
                _phases(engine, opt, batches, autocast, rec, step)
    if categories:
        rec.trace.categories = categories_at_peak(prof, mesh.device)
    if cuda_snapshot and mesh.device.type == "cuda":
        dump_cuda_history(cuda_snapshot.replace("RANK", str(mesh.rank)))
    got = measure(engine, opt)
    return (got.params, got.grads, got.optim), rec.trace


def measure_run(cfg, nproc: int, steps: int = 2, cuda_snapshot: str = "", categories: bool = False):
    """[(StateBytes after the last step, memtrace.Trace)] per rank, from ``steps`` real AdamW steps.
    ``cuda_snapshot``: a path with RANK in it for PyTorch's allocation history (CUDA only).
    ``categories``: profile the last step's allocations (``Trace.categories``; slower)."""
    from ..launch import run
    out = run(_measure_worker, nproc, cfg, steps, cuda_snapshot, categories, threads=1,
              timeout_s=max(cfg.train.timeout_s, 600),
              device=cfg.train.device if cfg.train.device != "auto" else "cpu")
    return [(StateBytes(*state), trace) for state, trace in out]
