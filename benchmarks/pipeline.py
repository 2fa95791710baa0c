"""Pipeline parallel benchmark: shardlab schedules vs torch.distributed.pipelining, CPU gloo.

    PYTHONPATH=. python benchmarks/pipeline.py [--pp 2 4] [--steps 6] [--out docs/img]
    PYTHONPATH=. python benchmarks/pipeline.py --split-costs   (one stage: backward vs B + W)

Same model, same stage split (shardlab's parameter-balanced partition; torch gets the very same
stage modules), m = 8 micro-batches, fp32, one thread per rank. Every engine is built up front
and the measured steps go round-robin over the engines, so load from other processes hits all
of them alike. Step time = forward + backward of one step (no optimizer), the slowest rank;
median and fastest of the steps (on a shared machine the fastest step is the least
disturbed). Measured bubble: 1 - busy / (ranks x span) from the executor's per-action
timestamps; simulated bubble: the simulator with the measured median F, B, W durations of
each stage (and again adding the measured hop latency of a message), and the step time that
simulation predicts when every rank has a core of its own (here 4 ranks share 2 cores, so a
rank's idle time is filled by another rank's work and the measured step mostly follows the
total CPU work, not the bubble). Simulated with shared cores: the same simulator with the
ranks time-sharing ``--cores`` cores (default: this machine's count), each action costing the
fastest duration observed for its kind and stage over all measured steps (an action with a core
to itself; under sharing a span only stretches), plus the hop latency; two policies bracket the
OS scheduler: processor sharing (every ready rank progresses, stretched) and run to completion
(at most ``cores`` actions at once, a rank waiting for a core is idle). Activation
memory: peak bytes of tensors saved for backward (autograd saved-tensor hooks, storage
de-duplicated, parameters excluded), one extra step per engine; for the split-backward schedules
(zb-h1, dualpipev) also the peak bytes held outside autograd for the deferred W (each module's
input and output gradient between B and W; the graph itself is freed at B). Parameter memory:
the largest parameter bytes held by one rank (dualpipe holds two stages per rank, a copy each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardlab.analysis.timeline import measured_bubble, plot_grid  # noqa: E402
from shardlab.config import Config  # noqa: E402
import shardlab.train.checks  # noqa: F401,E402  (registers every config check validate runs)
from shardlab.distributed.mesh import Mesh  # noqa: E402
from shardlab.distributed.topology import Topology  # noqa: E402
from shardlab.launch import run  # noqa: E402
from shardlab.models import build_model, get_spec  # noqa: E402
from shardlab.parallel.pipeline import apply  # noqa: E402
from shardlab.parallel.pipeline.schedule import build, theoretical_bubble  # noqa: E402
from shardlab.parallel.pipeline.simulate import simulate  # noqa: E402
from shardlab.parallel.pipeline.stage import split_model  # noqa: E402

M, MB = 8, 2


def make_cfg(pp: int, schedule: str, v: int, size: tuple = (128, 64)) -> Config:
    """``size``: (d_model, seq_len); 4 heads, 8 layers, vocabulary 256 whatever the size."""
    cfg = Config()
    m = cfg.model
    d, seq = size
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len = 256, d, 8, 4, seq
    cfg.train.seq_len, cfg.train.global_batch = seq, M * MB
    p = cfg.parallel
    p.pp, p.pp_schedule, p.pp_virtual, p.microbatches = pp, schedule, v, M
    return cfg.validate(pp)


def data(cfg):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.train.seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


class ActivationMeter:
    """Live bytes of tensors autograd saved for backward (storage de-duplicated), and the peak."""

    def __init__(self, exclude: set):
        self.exclude, self.live, self.bytes, self.peak = exclude, {}, 0, 0

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.exclude or ptr == 0:
            return t
        n, refs = self.live.get(ptr, (st.nbytes(), 0))
        if refs == 0:
            self.bytes += n
            self.peak = max(self.peak, self.bytes)
        self.live[ptr] = (n, refs + 1)
        return _Held(self, ptr, t.detach())  # detached: holding t itself would make a cycle t -> grad_fn -> t

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def release(self, ptr):
        n, refs = self.live[ptr]
        if refs == 1:
            del self.live[ptr]
            self.bytes -= n
        else:
            self.live[ptr] = (n, refs - 1)


class _Held:
    def __init__(self, meter, ptr, t):
        self.meter, self.ptr, self.t = meter, ptr, t

    def __del__(self):
        self.meter.release(self.ptr)


def shardlab_engine(mesh, pp, schedule, v, size):
    cfg = make_cfg(pp, schedule, v, size)
    engine = apply(build_model(cfg.model, 0), mesh, cfg, get_spec(cfg.model))
    x, y = data(cfg)
    mbs = list(zip(x.chunk(M), y.chunk(M)))

    def step():
        engine.model.zero_grad(set_to_none=True)
        engine.forward_backward(mbs)
    return step, engine


def torch_engine(mesh, pp, v, size):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
    cfg = make_cfg(pp, "interleaved" if v > 1 else "1f1b", v, size)
    model, chunks, _ = split_model(build_model(cfg.model, 0), get_spec(cfg.model), mesh.local_rank("pp"), pp, v)
    group = mesh.group("pp")
    stages = [PipelineStage(chunk, s, pp * v, torch.device("cpu"), group=group) for s, chunk in sorted(chunks.items())]
    loss_fn = lambda logits, y: model.criterion(logits, y)  # noqa: E731
    sched = (ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn) if v > 1
             else Schedule1F1B(stages[0], M, loss_fn=loss_fn))
    x, y = data(cfg)
    first, last = 0 in chunks, pp * v - 1 in chunks

    def step():
        model.zero_grad(set_to_none=True)
        args = (x,) if first else ()
        sched.step(*args, target=y if last else None, losses=[] if last else None, return_outputs=False)
    return step, model


ENGINES = [("shardlab 1f1b", "1f1b", 1), ("torch Schedule1F1B", "torch", 1),
           ("shardlab interleaved v=2", "interleaved", 2), ("torch ScheduleInterleaved1F1B v=2", "torch", 2),
           ("shardlab gpipe", "gpipe", 1), ("shardlab zb-h1", "zb-h1", 1), ("shardlab dualpipev", "dualpipev", 1),
           ("shardlab dualpipe", "dualpipe", 1)]


def worker(ctx, pp, steps, warmup, size, names, transport="process_group"):
    mesh = Mesh.build(Topology(pp=pp), transport=transport)
    comm = mesh.comm("pp")
    engines = {}
    for name, kind, v in ENGINES:
        if name in names:
            engines[name] = torch_engine(mesh, pp, v, size) if kind == "torch" else shardlab_engine(mesh, pp, kind, v, size)
    times = {name: [] for name in engines}
    timelines = {name: [] for name in engines}
    for i in range(warmup + steps):
        for name, (step, eng) in engines.items():
            comm.barrier()
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
                if hasattr(eng, "last_timeline"):
                    timelines[name].append([(a, s, e) for a, s, e in eng.last_timeline])
    memory, wmem, pmem = {}, {}, {}
    for name, (step, eng) in engines.items():
        model = eng.model if hasattr(eng, "model") else eng
        meter = ActivationMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
        comm.barrier()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            step()
        memory[name] = meter.peak
        pmem[name] = sum(p.numel() * p.element_size() for p in model.parameters())
        wmem[name] = getattr(eng, "wgrad_peak_bytes", 0)  # held outside autograd for deferred W
    return dict(times=times, timelines=timelines, memory=memory, wmem=wmem, pmem=pmem)


def hop_latency(timeline, n_stages: int) -> float:
    """Median time from a message's producer finishing to its consumer starting, over the
    actions whose rank sat idle waiting for that message: the latency of one hop (send, wake-up)."""
    ends = {(a.kind, a.mb, a.stage): e for rank in timeline for a, _, e in rank}
    gaps = []
    for rank in timeline:
        prev_end = None
        for a, s, e in rank:
            dep = (("F", a.mb, a.stage - 1) if a.kind == "F" and a.stage > 0 else
                   ("B", a.mb, a.stage + 1) if a.kind == "B" and a.stage < n_stages - 1 else None)
            if dep in ends and prev_end is not None and ends[dep] >= prev_end:
                gaps.append(s - ends[dep])
            prev_end = e
    return statistics.median(gaps) if gaps else 0.0


def summarise(pp, results, out_dir, cores, size, names):
    """Per engine: median and fastest step time (slowest rank); for shardlab schedules the
    measured bubble of the fastest step and of the median, and the simulated bubble with the
    step's median F, B, W durations per stage (with and without the measured hop latency)."""
    rows = []
    engines = [e for e in ENGINES if e[0] in names]
    n = len(results[0]["times"][engines[0][0]])
    steps = {name: [max(r["times"][name][i] for r in results) for i in range(n)] for name, _, _ in engines}
    for name, kind, v in engines:
        row = dict(pp=pp, engine=name, ms=1e3 * statistics.median(steps[name]), best=1e3 * min(steps[name]),
                   mem=max(r["memory"][name] for r in results) / 2**20,
                   wmem=max(r["wmem"][name] for r in results) / 2**20,
                   pmem=max(r["pmem"][name] for r in results) / 2**20)
        if kind != "torch":
            tls = [[r["timelines"][name][i] for r in results] for i in range(n)]
            fastest = tls[min(range(n), key=lambda i: steps[name][i])]
            # median duration of each action kind at each stage, measured in the fastest step
            per_stage = {}
            for rank_tl in fastest:
                for a, s, e in rank_tl:
                    per_stage.setdefault(a.stage, {}).setdefault(a.kind, []).append(e - s)
            per_stage = {st: {k: statistics.median(d) for k, d in kinds.items()} for st, kinds in per_stage.items()}
            sched = build(kind, pp, M, v)
            lat = hop_latency(fastest, sched.n_stages)
            sim = simulate(sched, stage_costs=per_stage)
            alone = {}  # fastest span of each action kind at each stage over all measured steps
            for a, s, e in (x for tl in tls for rank_tl in tl for x in rank_tl):
                alone.setdefault(a.stage, {})[a.kind] = min(e - s, alone.get(a.stage, {}).get(a.kind, float("inf")))
            shared = simulate(sched, comm=lat, stage_costs=alone, cores=cores)
            fifo = simulate(sched, comm=lat, stage_costs=alone, cores=cores, sharing="fifo")
            row.update(bubble=measured_bubble(fastest), bubble_med=statistics.median(map(measured_bubble, tls)),
                       sim=sim.bubble, sim_ms=1e3 * sim.makespan, lat=lat,
                       sim_lat=simulate(sched, comm=lat, stage_costs=per_stage).bubble,
                       theory=theoretical_bubble(kind, pp, M, v), shared=shared.bubble,
                       shared_ms=1e3 * shared.makespan, fifo=fifo.bubble, fifo_ms=1e3 * fifo.makespan)
            if out_dir:
                tag = "" if size == (128, 64) else f"_d{size[0]}_s{size[1]}"
                sim_hop = simulate(sched, comm=lat, stage_costs=per_stage)
                plot_grid([(fastest, f"measured {name}, pp={pp}, m={M} (fastest of {n} steps): bubble {row['bubble']:.3f}"),
                           (sim_hop.timeline, f"simulated with its stage costs and {1e3 * lat:.1f} ms hops: "
                                              f"bubble {sim_hop.bubble:.3f}")],
                          str(Path(out_dir) / f"pipeline_measured_{kind}_pp{pp}{tag}.png"))
        rows.append(row)
    for mine, ref in (("shardlab 1f1b", "torch Schedule1F1B"),
                      ("shardlab interleaved v=2", "torch ScheduleInterleaved1F1B v=2")):
        if mine not in steps or ref not in steps:
            continue
        row = next(r for r in rows if r["engine"] == mine)
        row["ratio"] = statistics.median(steps[mine]) / statistics.median(steps[ref])
        row["ratio_best"] = min(steps[mine]) / min(steps[ref])
    return rows


def split_costs(reps: int = 15, size: tuple = (128, 64)) -> None:
    """One stage of the pp = 4 split (2 of the 8 layers), one process, one thread, micro-batch
    MB: 1F1B's full backward vs ZB's B (input grads) + W (wgrad.py), and W of k micro-batches
    batched into one matmul per module (inputs and output grads concatenated, cat included)."""
    from shardlab.parallel.pipeline.wgrad import direct_input, weight_grads
    torch.set_num_threads(1)
    cfg = make_cfg(1, "1f1b", 1, size)
    cfg.model.n_layers = 2
    d, seq = size
    model = build_model(cfg.model, 0)
    blocks, cap, pos = list(model.layers.values()), [None], torch.arange(seq)

    def hook(mod, args, out):
        if cap[0] is not None and torch.is_tensor(out) and out.requires_grad:
            cap[0].append((mod, out, direct_input(mod, args)))
    for mod in model.layers.modules():
        if any(p.requires_grad for p in mod.parameters(recurse=False)):
            mod.register_forward_hook(hook)
    g = torch.Generator().manual_seed(0)
    xs, gs = ([torch.randn(MB, seq, d, generator=g) for _ in range(4)] for _ in range(2))

    def fwd(i, capture):
        x = xs[i].clone().requires_grad_()
        cap[0], out = [] if capture else None, x
        for b in blocks:
            out = b(out, pos)
        c, cap[0] = cap[0], None
        return x, out, c

    def w_pass(group):  # W of the micro-batches in ``group``, one matmul per module
        for j, (mod, inp, gr) in enumerate(group[0]):
            if gr is not None:
                weight_grads(mod, torch.cat([e[j][1] for e in group]), torch.cat([e[j][2] for e in group]))
    times: dict = {}

    def timed(name, fn, per):
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(1e3 * (time.perf_counter() - t0) / per)
        return out
    for _ in range(reps + 2):
        for i in range(4):
            _, out, _ = fwd(i, False)
            timed("full backward (1F1B)", lambda: torch.autograd.backward(out, gs[i]), 1)
        entries = []
        for i in range(4):
            x, out, c = fwd(i, True)
            grads = timed("B (ZB)", lambda: torch.autograd.grad(out, [x] + [z for _, z, _ in c], gs[i],
                                                                   allow_unused=True), 1)
            entries.append([(mod, inp, gr) for (mod, _, inp), gr in zip(c, grads[1:])])
        timed("W one micro-batch at a time (ZB now)", lambda: [w_pass([e]) for e in entries], 4)
        timed("W batched over 2 micro-batches", lambda: [w_pass(entries[k:k + 2]) for k in (0, 2)], 4)
        timed("W batched over 4 micro-batches", lambda: w_pass(entries), 4)
    print(f"\nOne pp = 4 stage (2 layers, d {d}, seq {seq}, micro-batch {MB}), 1 thread, ms per micro-batch "
          f"(median of {reps}):")
    print("| pass | ms |\n|---|---|")
    for name, v in times.items():
        print(f"| {name} | {statistics.median(v[2 * len(v) // (reps + 2):]):.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores the ranks share, for the shared-cores simulation (default: this machine's)")
    ap.add_argument("--out", default="", help="folder for measured timeline PNGs")
    ap.add_argument("--split-costs", action="store_true", help="only: one stage's full backward vs B + W, W batched")
    ap.add_argument("--d-model", type=int, default=128, help="model width (default 128: overhead-bound steps)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--transport", default="process_group", choices=("process_group", "shared"),
                    help="shardlab's stage-to-stage messages: gloo (default) or the shared-memory rings "
                         "(distributed/shm_p2p.py); torch's engines always use gloo")
    ap.add_argument("--engines", default="", help="comma-separated schedules to run, e.g. 1f1b,zb-h1 (default: all, "
                    "and torch's); 'torch' names torch.distributed.pipelining's")
    args = ap.parse_args(argv)
    size = (args.d_model, args.seq)
    if args.split_costs:
        return split_costs(size=size)
    kinds = set(filter(None, args.engines.split(",")))
    names = [n for n, k, _ in ENGINES if not kinds or k in kinds]
    if not names:
        print(f"--engines: none of {sorted(kinds)} is a schedule here; pick from "
              f"{sorted({k for _, k, _ in ENGINES})}", file=sys.stderr)
        sys.exit(2)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    all_rows = []
    for pp in args.pp:
        results = run(worker, pp, pp, args.steps, args.warmup, size, names, args.transport, timeout_s=600, threads=1)
        all_rows += summarise(pp, results, args.out, args.cores, size, names)
    print(f"\nmodel: 8 layers, d_model {size[0]}, seq {size[1]}, micro-batch {MB}, m = {M}, fp32, CPU, "
          f"stage messages: {args.transport}, 1 thread/rank")
    print("| pp | engine | step ms median | fastest | vs torch (median / fastest) | bubble measured "
          "(fastest step / median) | simulated, measured stage costs | + measured hop latency | theory F=B=W "
          f"| simulated step ms, one core per rank | simulated, {args.cores} cores shared: processor sharing "
          "/ run to completion (step ms) | peak saved activations MiB | + held for deferred W MiB "
          "| parameters MiB, largest rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in all_rows:
        ratio = f"{r['ratio']:.2f}x / {r['ratio_best']:.2f}x" if "ratio" in r else ""
        bub = (f"{r['bubble']:.3f} / {r['bubble_med']:.3f} | {r['sim']:.3f} | {r['sim_lat']:.3f} "
               f"({1e3 * r['lat']:.1f} ms) | {r['theory']:.3f} | {r['sim_ms']:.1f} | {r['shared']:.3f} ({r['shared_ms']:.1f}) / "
               f"{r['fifo']:.3f} ({r['fifo_ms']:.1f})"
               if "bubble" in r else "- | - | - | - | - | -")
        wm = f"{r['wmem']:.2f}" if r["wmem"] else "-"
        print(f"| {r['pp']} | {r['engine']} | {r['ms']:.1f} | {r['best']:.1f} | {ratio} | {bub} | {r['mem']:.2f} | {wm} | {r['pmem']:.2f} |")


if __name__ == "__main__":
    main()
