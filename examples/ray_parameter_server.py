"""A parameter server on Ray actors, against shardlab DDP on the same model and data (docs/ray.md).

    python examples/ray_parameter_server.py --workers 2 --steps 50

A ``ParameterServer`` actor holds the model's parameters (one flat float32 vector) and applies SGD;
``Worker`` actors pull the parameters, compute a gradient on their own data shard and push it.

* sync: every step each worker pulls, computes and pushes; the server averages the N gradients,
  applies one update and the next pull broadcasts it (mathematically DDP with SGD);
* async: each worker loops on its own; the server applies every gradient as it arrives. A gradient
  computed on parameters more than ``--staleness`` updates old is refused (bounded staleness) and
  the worker pulls again. One "step" = N gradients, the same work as a sync or DDP step.

Bytes moved per step are counted by the server: the tensor bytes of every pull (parameters out)
and every push (gradient in). DDP's bytes are the ring all-reduce's 2M(N-1)/N per rank, taken from
shardlab's ledger (modelled for gloo's all-reduce), summed over the ranks.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import ray

D_IN, HIDDEN = 32, 256


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def batch(seed: int, shard: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``shard``'s batch of step ``step``: y = a fixed smooth function of x, plus noise."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + shard * 10_007 + step)
    x = torch.randn(size, D_IN, generator=g)
    w = torch.Generator().manual_seed(seed)
    target = torch.randn(D_IN, 1, generator=w)
    return x, torch.sin(x @ target) + 0.05 * torch.randn(size, 1, generator=g)


def eval_loss(model, seed: int) -> float:
    x, y = batch(seed, 999, 0, 1024)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def _flat(model):
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


class ParameterServer:
    def __init__(self, seed: int, lr: float, n_workers: int, staleness: int):
        self.model = make_model(seed)
        self.params = _flat(self.model)
        self.lr, self.n, self.staleness = lr, n_workers, staleness
        self.version, self.pending = 0, []
        self.bytes_moved, self.refused = 0, 0

    def pull(self):
        self.bytes_moved += self.params.numel() * self.params.element_size()
        return self.params, self.version

    def push_sync(self, grad: torch.Tensor) -> None:
        """Collect N gradients, then one averaged update (the workers wait for the step to end)."""
        self.bytes_moved += grad.numel() * grad.element_size()
        self.pending.append(grad)
        if len(self.pending) == self.n:
            self.params -= self.lr * torch.stack(self.pending).mean(0)
            self.pending, self.version = [], self.version + 1

    def push_async(self, grad: torch.Tensor, version: int) -> bool:
        """Apply at once unless the gradient is more than ``staleness`` updates old."""
        self.bytes_moved += grad.numel() * grad.element_size()
        if self.version - version > self.staleness:
            self.refused += 1
            return False
        self.params -= self.lr / self.n * grad  # N async updates ~ one averaged sync step
        self.version += 1
        return True

    def stats(self):
        return self.bytes_moved, self.refused, self.version

    def loss(self, seed: int) -> float:
        torch.nn.utils.vector_to_parameters(self.params, self.model.parameters())
        return eval_loss(self.model, seed)


class Worker:
    def __init__(self, seed: int, shard: int, batch_size: int):
        torch.set_num_threads(1)
        self.model, self.seed, self.shard, self.bs, self.step = make_model(seed), seed, shard, batch_size, 0

    def _grad(self, params):
        torch.nn.utils.vector_to_parameters(params, self.model.parameters())
        self.model.zero_grad()
        x, y = batch(self.seed, self.shard, self.step, self.bs)
        F.mse_loss(self.model(x), y).backward()
        self.step += 1
        return torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])

    def sync_step(self, server) -> None:
        params, _ = ray.get(server.pull.remote())
        ray.get(server.push_sync.remote(self._grad(params)))

    def async_run(self, server, updates: int) -> None:
        done = 0
        while done < updates:
            params, version = ray.get(server.pull.remote())
            done += ray.get(server.push_async.remote(self._grad(params), version))


def run_ps(mode: str, args) -> dict:
    server = ray.remote(num_cpus=0)(ParameterServer).remote(args.seed, args.lr, args.workers, args.staleness)
    workers = [ray.remote(num_cpus=1)(Worker).remote(args.seed, i, args.batch) for i in range(args.workers)]
    ray.get([w.__ray_ready__.remote() for w in workers])
    t0 = time.perf_counter()
    if mode == "sync":
        for _ in range(args.steps):
            ray.get([w.sync_step.remote(server) for w in workers])
    else:
        ray.get([w.async_run.remote(server, args.steps) for w in workers])
    dt = time.perf_counter() - t0
    moved, refused, version = ray.get(server.stats.remote())
    loss = ray.get(server.loss.remote(args.seed))
    for a in (server, *workers):
        ray.kill(a)
    return {"name": f"parameter server, {mode}", "step_s": dt / args.steps, "bytes": moved / args.steps,
            "loss": loss, "note": f"{refused} stale gradients refused" if mode == "async" else ""}


def _ddp_rank(ctx, args):
    import shardlab
    model = make_model(args.seed)
    engine = shardlab.initialize(model, {"train": {"device": "cpu", "grad_clip": 0.0, "weight_decay": 0.0}},
                                 optimizer=lambda groups: torch.optim.SGD(groups, lr=args.lr))
    snap = engine.mesh.ledger.snapshot()
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(args.seed, ctx.rank, step, args.batch)
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    dt = time.perf_counter() - t0
    sent = sum(e.bytes_sent for e in engine.mesh.ledger.since(snap).values())
    return dt, sent, eval_loss(model, args.seed)


def run_ddp(args) -> dict:
    from shardlab.launch import run
    out = run(_ddp_rank, args.workers, args, threads=1)
    return {"name": "shardlab DDP (all-reduce)", "step_s": max(o[0] for o in out) / args.steps,
            "bytes": sum(o[1] for o in out) / args.steps, "loss": out[0][2], "note": "ledger: ring 2M(N-1)/N per rank"}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64, help="per-worker batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--staleness", type=int, default=None, help="async: max updates a gradient may lag (default N-1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.staleness = args.workers - 1 if args.staleness is None else args.staleness
    if __name__ != "__main__":  # imported (the smoke test): Ray's workers get the classes by value
        import sys
        from ray import cloudpickle
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(args.workers, 2), include_dashboard=False, object_store_memory=100 * 2 ** 20,
                 log_to_driver=False)
    try:
        rows = [run_ps("sync", args), run_ps("async", args), run_ddp(args)]
    finally:
        if started:
            ray.shutdown()
    n_params = sum(p.numel() for p in make_model(args.seed).parameters())
    print(f"\n{n_params:,}-parameter MLP (M = {4 * n_params / 2**20:.3f} MiB fp32), {args.workers} workers, "
          f"batch {args.batch}/worker, SGD lr {args.lr}, {args.steps} steps; initial eval loss "
          f"{eval_loss(make_model(args.seed), args.seed):.4f}\n")
    print("| method | time/step (ms) | bytes moved/step (MiB, all workers) | eval loss after N steps | note |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['name']} | {1e3 * r['step_s']:.1f} | {r['bytes'] / 2**20:.3f} | {r['loss']:.4f} | {r['note']} |")
    return rows


if __name__ == "__main__":
    main()
