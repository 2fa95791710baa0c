"""``shardlab verify [--arch A] [--nproc N] [--layouts a,b,...] [--steps K]``: the parity matrix,
every layout against an independent single-process float64 reference (docs/composition.md,
"shardlab verify"). A layout names the degrees it needs; the remaining ranks become data
parallel (dp_replicate, or dp_shard for ZeRO/FSDP layouts)."""
from __future__ import annotations

import math
import time

import torch

from .. import config as C
from .. import launch
from ..distributed.mesh import Mesh
from ..distributed.topology import Topology
from ..models.spec import add_adapters, get_spec, init_weights, meta_model
from ..train import checks  # noqa: F401  (registers every config check validate runs)
from ..train.data import Loader, TokenData
from ..train.optim import lr_at

TOL = 1e-10
DEFAULT_ARCH = C.ModelConfig().arch
BASE = {"model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
                  "max_seq_len": 32},
        "train": {"seq_len": 32, "global_batch": 16, "precision": "fp64", "warmup_steps": 1, "lr": 1e-2,
                  "grad_clip": 0.5, "eval_batches": 1},
        "parallel": {},
        "logging": {"progress": False, "tensorboard": False}}
MOE = {"n_experts": 4, "moe_top_k": 2, "moe_capacity_factor": 0.0}

HIER = {"sim_nodes": 2, "ep_dispatch": "hierarchical"}  # ep over 2 simulated nodes, forwarded inside them
UNTIED = {"tie_embeddings": False}  # pipeline stages cannot share the embedding with the head
# name -> (parallel degrees/options, model overrides, data-parallel fill axis)
LAYOUTS: dict[str, tuple[dict, dict, str]] = {
    "dp": ({}, {}, "dp_replicate"),
    "dp-accum": ({"microbatches": 2}, {}, "dp_replicate"),
    "dp-ac-full": ({"activation_checkpointing": "full"}, {}, "dp_replicate"),
    "zero1": ({"zero_stage": 1}, {}, "dp_shard"),
    "zero2": ({"zero_stage": 2}, {}, "dp_shard"),
    "fsdp": ({"zero_stage": 3}, {}, "dp_shard"),
    "hsdp": ({"zero_stage": 3, "dp_replicate": 2}, {}, "dp_shard"),
    "tp2": ({"tp": 2}, {}, "dp_replicate"),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, "dp_replicate"),
    "tp4": ({"tp": 4}, {}, "dp_replicate"),
    "tp2-fsdp": ({"tp": 2, "zero_stage": 3}, {}, "dp_shard"),
    "tp2-ac-selective": ({"tp": 2, "activation_checkpointing": "selective"}, {}, "dp_replicate"),
    "fsdp-ac-full": ({"zero_stage": 3, "activation_checkpointing": "full"}, {}, "dp_shard"),
    "dp-ac-op": ({"activation_checkpointing": "op"}, {}, "dp_replicate"),
    "fsdp-ac-op": ({"zero_stage": 3, "activation_checkpointing": "op"}, {}, "dp_shard"),
    "tp2-sp-ac-op": ({"tp": 2, "sequence_parallel": True, "activation_checkpointing": "op"}, {}, "dp_replicate"),
    "pp2-gpipe": ({"pp": 2, "pp_schedule": "gpipe", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp2-1f1b": ({"pp": 2, "pp_schedule": "1f1b", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp2-interleaved": ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2, "microbatches": 4}, UNTIED,
                        "dp_replicate"),
    "pp2-interleaved-ends": ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2, "pp_split": "ends",
                              "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp2-zb": ({"pp": 2, "pp_schedule": "zb-h1", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp2-fsdp": ({"pp": 2, "zero_stage": 3, "microbatches": 4}, UNTIED, "dp_shard"),
    "pp2-fsdp-zb": ({"pp": 2, "zero_stage": 3, "pp_schedule": "zb-h1", "microbatches": 4}, UNTIED, "dp_shard"),
    "pp2-zero1": ({"pp": 2, "zero_stage": 1, "microbatches": 4}, UNTIED, "dp_shard"),
    "pp2-hsdp": ({"pp": 2, "zero_stage": 3, "dp_replicate": 2, "microbatches": 2}, UNTIED, "dp_shard"),
    "pp4-zb": ({"pp": 4, "pp_schedule": "zb-h1", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp2-dualpipev": ({"pp": 2, "pp_schedule": "dualpipev", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp4-dualpipev": ({"pp": 4, "pp_schedule": "dualpipev", "microbatches": 8}, {**UNTIED, "n_layers": 8},
                      "dp_replicate"),
    "pp2-dualpipe": ({"pp": 2, "pp_schedule": "dualpipe", "microbatches": 4}, UNTIED, "dp_replicate"),
    "pp4-dualpipe": ({"pp": 4, "pp_schedule": "dualpipe", "microbatches": 8}, {**UNTIED, "n_layers": 8},
                     "dp_replicate"),
    "pp2-tp2": ({"pp": 2, "tp": 2, "microbatches": 2}, UNTIED, "dp_replicate"),
    "cp2": ({"cp": 2}, {}, "dp_replicate"),
    "pp2-cp2": ({"pp": 2, "cp": 2, "microbatches": 2}, UNTIED, "dp_replicate"),
    "cp2-tp2": ({"cp": 2, "tp": 2}, {}, "dp_replicate"),
    "cp2-ulysses": ({"cp": 2, "cp_impl": "ulysses"}, {}, "dp_replicate"),
    "cp4-ulysses": ({"cp": 4, "cp_impl": "ulysses"}, {}, "dp_replicate"),
    "cp4-unified": ({"cp": 4, "cp_impl": "unified", "cp_ulysses": 2}, {}, "dp_replicate"),
    "cp2-ulysses-tp2": ({"cp": 2, "cp_impl": "ulysses", "tp": 2}, {}, "dp_replicate"),
    "pp2-cp2-ulysses": ({"pp": 2, "cp": 2, "cp_impl": "ulysses", "microbatches": 2}, UNTIED, "dp_replicate"),
    "cp2-ulysses-fsdp": ({"cp": 2, "cp_impl": "ulysses", "zero_stage": 3}, {}, "dp_shard"),
    "dp2-tp2-pp2": ({"dp_replicate": 2, "tp": 2, "pp": 2, "microbatches": 2}, UNTIED, "dp_replicate"),
    "tp2-sp-pp2": ({"tp": 2, "sequence_parallel": True, "pp": 2, "microbatches": 2}, UNTIED, "dp_replicate"),
    "ep2": ({"ep": 2, "dp_shard": 2}, MOE, "dp_replicate"),
    "ep2-ac-op": ({"ep": 2, "dp_shard": 2, "activation_checkpointing": "op"}, MOE, "dp_replicate"),
    "ep4": ({"ep": 4, "dp_shard": 4}, MOE, "dp_replicate"),
    "moe-dp": ({}, MOE, "dp_replicate"),
    "ep2-tp2": ({"ep": 2, "dp_shard": 2, "tp": 2}, MOE, "dp_replicate"),
    "ep2-cp2": ({"ep": 2, "cp": 2}, MOE, "dp_replicate"),
    "pp2-moe": ({"pp": 2, "microbatches": 4}, {**MOE, **UNTIED}, "dp_replicate"),
    "pp2-ep2": ({"pp": 2, "ep": 2, "dp_shard": 2, "microbatches": 2}, {**MOE, **UNTIED}, "dp_replicate"),
    "ep2-zero1": ({"ep": 2, "dp_shard": 2, "zero_stage": 1}, MOE, "dp_shard"),
    "ep2-zero2": ({"ep": 2, "dp_shard": 2, "zero_stage": 2}, MOE, "dp_shard"),
    "ep2-fsdp": ({"ep": 2, "dp_shard": 4, "zero_stage": 3}, MOE, "dp_shard"),
    "ep2-hsdp": ({"ep": 2, "dp_shard": 2, "dp_replicate": 2, "zero_stage": 3}, MOE, "dp_replicate"),
    # two tiers (docs/expert-parallel.md): simulated nodes, hierarchical dispatch, node-limited routing
    "ep4-hier": ({"ep": 4, "dp_shard": 4, **HIER}, MOE, "dp_replicate"),
    "ep4-hier-cap": ({"ep": 4, "dp_shard": 4, **HIER}, {**MOE, "moe_capacity_factor": 2.0}, "dp_replicate"),
    "ep4-hier-m1": ({"ep": 4, "dp_shard": 4, **HIER}, {**MOE, "moe_node_groups": 2, "moe_max_nodes": 1},
                    "dp_replicate"),
    "ep4-overlap": ({"ep": 4, "dp_shard": 4, "sim_nodes": 2, "ep_overlap": 2}, {**MOE, "moe_capacity_factor": 2.0},
                    "dp_replicate"),
    "pp2-dualpipe-ep2-overlap": ({"pp": 2, "pp_schedule": "dualpipe", "microbatches": 4, "ep": 2, "dp_shard": 2,
                                  "ep_overlap": 2}, {**MOE, **UNTIED}, "dp_replicate"),
    "ep4-hier-overlap": ({"ep": 4, "dp_shard": 4, **HIER, "ep_overlap": 2}, {**MOE, "moe_capacity_factor": 2.0},
                         "dp_replicate"),
    # DualPipe's F&B pairs as lanes: one micro-batch's all-to-alls beside the other's compute
    "pp2-dualpipe-ep2-fb": ({"pp": 2, "pp_schedule": "dualpipe", "microbatches": 4, "ep": 2, "dp_shard": 2,
                             "pp_overlap": True}, {**MOE, **UNTIED}, "dp_replicate"),
    "pp2-dualpipev-ep2-fb": ({"pp": 2, "pp_schedule": "dualpipev", "microbatches": 4, "ep": 2, "dp_shard": 2,
                              "pp_overlap": True}, {**MOE, **UNTIED}, "dp_replicate"),
    "pp2-dualpipe-ep2-hier-fb": ({"pp": 2, "pp_schedule": "dualpipe", "microbatches": 4, "ep": 2, "dp_shard": 2,
                                  "pp_overlap": True, **HIER, "sim_nodes": 4}, {**MOE, **UNTIED}, "dp_replicate"),
    "ep2-hier-dp": ({"ep": 2, "dp_shard": 2, "dp_replicate": 2, **HIER, "sim_nodes": 4}, MOE, "dp_replicate"),
    "pp2-ep2-hier": ({"pp": 2, "ep": 2, "dp_shard": 2, "microbatches": 2, **HIER, "sim_nodes": 4}, {**MOE, **UNTIED},
                     "dp_replicate"),
}


def layouts(arch: str = DEFAULT_ARCH) -> list[str]:
    """The layouts of ``arch``: all of LAYOUTS, the MoE ones only when its spec has MoE blocks."""
    spec = get_spec(arch)
    return [n for n, (_, model, _) in LAYOUTS.items() if spec.moe or not model.get("n_experts")]


def _merge(base: dict, extra: dict) -> dict:
    return {k: ({**base.get(k, {}), **extra[k]} if isinstance(extra.get(k), dict) else extra.get(k, base.get(k)))
            for k in {**base, **extra}}


def layout_config(name: str, nproc: int, steps: int = 3, arch: str = DEFAULT_ARCH,
                  extra: dict | None = None) -> C.Config | None:
    """The config of layout ``name`` on ``nproc`` ranks for ``arch``, or None when it does not fit.
    ``extra``: {section: {key: value}} applied on top (e.g. a shorter train.seq_len in tests)."""
    par, model, fill = LAYOUTS[name]
    base = _merge(BASE, {"model": {**get_spec(arch).verify_model, "arch": arch, **model},
                         "train": {"steps": steps}, "parallel": dict(par)})
    cfg = C.from_dict(_merge(base, extra or {}))
    used = cfg.parallel.world_size
    if nproc % used:
        return None
    setattr(cfg.parallel, fill, getattr(cfg.parallel, fill) * (nproc // used))
    try:
        cfg.validate(nproc)
    except C.ConfigError:
        return None
    return cfg


def describe(cfg: C.Config) -> str:
    p = cfg.parallel
    extra = [f"zero{p.zero_stage}" if p.zero_stage else "", "sp" if p.sequence_parallel else "",
             f"ac-{p.activation_checkpointing}" if p.activation_checkpointing != "none" else "",
             p.pp_schedule if p.pp > 1 else "", "split-ends" if p.pp > 1 and p.pp_split == "ends" else "",
             f"m{p.microbatches}" if p.microbatches > 1 else "",
             f"E{cfg.model.n_experts}" if cfg.model.n_experts else "",
             p.ep_dispatch if p.ep > 1 and p.ep_dispatch == "hierarchical" else "",
             "overlap" if p.ep > 1 and p.ep_overlap else "", "F&B lanes" if p.pp > 1 and p.pp_overlap else "",
             f"cap{cfg.model.moe_capacity_factor:g}" if cfg.model.moe_capacity_factor else "",
             f"M{cfg.model.moe_max_nodes}/{cfg.model.moe_node_groups}" if cfg.model.moe_max_nodes else ""]
    return " ".join([Topology.from_config(p).describe()] + [e for e in extra if e])


def reference_adamw(model, t) -> torch.optim.AdamW:
    """Plain torch AdamW over a single-process model: weight decay on matrices, none on norms
    and vectors (the grouping every engine uses), or on every parameter (weight_decay_params=all)."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if (p.ndim >= 2 and "norm" not in n) or t.weight_decay_params == "all"]
    rest = [p for n, p in named if all(p is not q for q in decay)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


def reference_model(cfg: C.Config) -> torch.nn.Module:
    """The whole float64 model of ``cfg`` on one process (with LoRA adapters when configured)."""
    model = meta_model(cfg.model, torch.float64)
    if cfg.train.lora_rank:
        add_adapters(model, cfg.train)
    return init_weights(model, cfg.model, cfg.train.seed)


def plain_run(cfg: C.Config, batches) -> tuple[list, list, dict]:
    """One process, whole global batches, plain torch (no shardlab engine): the model of ``cfg``
    in float64 trained by torch AdamW with clipping on ``batches`` (an iterable of (x, y)).
    Returns (losses, gradient norms, {model.<name>, optim.<name>.exp_avg(_sq): tensors})."""
    model = reference_model(cfg)
    opt = reference_adamw(model, cfg.train)
    losses, norms = [], []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            state[f"optim.{names[id(p)]}.{k}"] = st[k].clone()
    return losses, norms, state


def reference(cfg: C.Config, data_dir: str, steps: int):
    """Independent single-process run: plain model, torch AdamW, whole global batch."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = reference_model(cfg)
    opt = reference_adamw(model, t)
    loader = Loader(TokenData(data_dir), t.seq_len, t.global_batch, 1, 0, 1, t.seed)
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        (x, y), = loader.next_batch()
        total = 0.0
        micro = _micro_rows(cfg)
        for rows in micro:  # MoE aux losses are per micro-batch: accumulate as the engines do
            loss = model(x[rows], y[rows]) / len(micro)
            loss.backward()
            total += loss.item()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}


def _micro_rows(cfg: C.Config) -> list:
    """The global batch's rows per micro-batch. Dense models: one slice, the whole batch (a mean
    over tokens does not depend on the grouping). MoE with micro-batches: micro-batch j is the j-th
    chunk of every data-parallel rank's share, because router aux losses are computed per
    micro-batch (over all dp ranks' tokens of that micro-batch)."""
    p, b = cfg.parallel, cfg.train.global_batch
    m = p.microbatches
    if not cfg.model.n_experts or m == 1:
        return [slice(None)]
    dp = p.dp_replicate * p.dp_shard
    per = b // dp
    return [[r for d in range(dp) for r in range(d * per + j * per // m, d * per + (j + 1) * per // m)]
            for j in range(m)]


def _worker(ctx, cfg: C.Config, data_dir: str, steps: int):
    from ..train.loop import Trainer
    mesh = Mesh.build(Topology.from_config(cfg.parallel), ctx.device, transport=cfg.parallel.comm_transport,
                      comm_thread=cfg.parallel.comm_thread)
    tr = Trainer(cfg, mesh, TokenData(data_dir))
    losses = []
    snap = mesh.ledger.snapshot()
    for _ in range(steps):
        losses.append(tr.engine.global_loss(tr.train_step()["local_loss"]))
    sent = sum(e.bytes_sent for e in mesh.ledger.since(snap).values()) / steps
    state = tr.engine.full_state(tr.optimizer)
    params = {k: v for k, v in state.items() if k.startswith("model.")}
    return losses, params, sent


def reference_key(cfg: C.Config) -> tuple:
    """Layouts whose model and train sections agree share one reference run."""
    p = cfg.parallel
    grouping = (p.dp_replicate * p.dp_shard, p.microbatches) if cfg.model.n_experts and p.microbatches > 1 else ()
    return repr(cfg.model), repr(cfg.train), grouping


def _compare(row: dict, out: list, ref: tuple) -> dict:
    """Fill ``row`` from the ranks' results ``out`` against the reference (losses, params)."""
    ref_losses, ref_params = ref
    losses, params, _ = out[0]
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    missing = sorted(set(ref_params) - set(params))
    param_diff = max(((params[k] - v).abs().max().item() for k, v in ref_params.items() if k in params),
                     default=math.inf)
    row.update(loss_diff=loss_diff, param_diff=param_diff if not missing else math.inf,
               bytes_per_step=sum(o[2] for o in out),
               ok=loss_diff <= TOL and param_diff <= TOL and not missing,
               error=f"missing {missing[:2]}" if missing else "")
    return row


def _reference_for(cfg: C.Config, data_dir: str, steps: int, ref_cache: dict) -> tuple:
    key = reference_key(cfg)
    if key not in ref_cache:
        ref_cache[key] = reference(cfg, data_dir, steps)
    return ref_cache[key]


def run_layout(name: str, nproc: int, data_dir: str, steps: int, ref_cache: dict, arch: str = DEFAULT_ARCH,
               extra: dict | None = None) -> dict:
    """One layout vs the reference (computed once per distinct model/train config, in ``ref_cache``)."""
    cfg = layout_config(name, nproc, steps, arch, extra)
    ref = _reference_for(cfg, data_dir, steps, ref_cache)
    t0 = time.time()
    row = {"layout": name, "ranks": nproc, "detail": describe(cfg)}
    try:
        out = launch.run(_worker, nproc, cfg, data_dir, steps, timeout_s=120)
    except (launch.WorkerError, NotImplementedError) as e:
        first = str(e).strip().splitlines()
        row.update(ok=False, error=" ".join(first[:2])[:160], seconds=time.time() - t0)
        return row
    return _compare(row, out, ref) | {"seconds": time.time() - t0}


def _many_worker(ctx, cfgs: list, data_dir: str, steps: int):
    return [_worker(ctx, cfg, data_dir, steps) for cfg in cfgs]


def run_layouts(names: list[str], nproc: int, data_dir: str, steps: int, ref_cache: dict, arch: str = DEFAULT_ARCH,
                extra: dict | None = None) -> list[dict]:
    """Several layouts (all fitting ``nproc``) in one spawn of ``nproc`` ranks, each against its
    reference: the rows of :func:`run_layout`, without a process start per layout (tests).
    A failing rank fails the whole call (launch.WorkerError)."""
    cfgs = [layout_config(n, nproc, steps, arch, extra) for n in names]
    unfit = [n for n, c in zip(names, cfgs) if c is None]
    if unfit:
        raise ValueError(f"layouts {unfit} do not fit {nproc} ranks for {arch}")
    refs = [_reference_for(c, data_dir, steps, ref_cache) for c in cfgs]
    out = launch.run(_many_worker, nproc, cfgs, data_dir, steps, timeout_s=300)
    return [_compare({"layout": n, "ranks": nproc, "detail": describe(c)}, [o[i] for o in out], ref)
            for i, (n, c, ref) in enumerate(zip(names, cfgs, refs))]
