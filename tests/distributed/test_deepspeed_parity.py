"""A DeepSpeed JSON means what it means in DeepSpeed (docs/deepspeed.md, DeepSpeed JSON semantics).

The same JSON through ``shardlab.initialize`` at N=2, ZeRO 0-3, against
- an independent plain-torch computation (float64, one process, the whole batch, torch AdamW
  with weight decay on every parameter, DeepSpeed's schedules written out here from their
  documented formulas, clipping at ``gradient_clipping``, 1.0 when absent as in DeepSpeed): <= 1e-10;
- ``deepspeed.initialize`` itself on the CPU accelerator (fp32, 10 steps), when deepspeed is
  installed (``DS_BUILD_OPS=0 pip install deepspeed``; in the test extra): <= 2e-6; also with two
  user param groups (``model_parameters``) of different weight decay and lr.
"""
import math
import os

import pytest
import torch
from torch import nn

import shardlab
from shardlab import launch

PARITY_ATOL = 1e-10
G, D_IN = 8, 6  # global batch of 8 rows


class Net(nn.Module):
    """A user's module: a conv, a norm, biases: every kind of parameter DeepSpeed decays."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 3, 3, padding=1)
        self.norm = nn.LayerNorm(3 * D_IN)
        self.fc = nn.Linear(3 * D_IN, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.conv(x.unsqueeze(1)).flatten(1)
        return self.head(torch.tanh(self.fc(self.norm(h))))


def make(dtype):
    torch.manual_seed(0)
    return Net().to(dtype)


def batch(step, dtype):
    g = torch.Generator().manual_seed(50 + step)
    x = torch.randn(G, D_IN, generator=g, dtype=torch.float64)
    return x.to(dtype), (4 * x.sum(1, keepdim=True).cos()).to(dtype)  # gradient norms ~1: clipping bites


def ds_config(stage, scheduler=None, clip=None, ga=2):
    cfg = {"train_batch_size": G, "gradient_accumulation_steps": ga,  # micro = 8 / (ga * 2 ranks)
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.05, "torch_adam": True}},
           "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    if scheduler:
        cfg["scheduler"] = scheduler
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def ds_schedule_lr(kind, params, it, base):
    """DeepSpeed's lr after ``it`` scheduler steps, from the formulas in its documentation."""
    w = max(2, params.get("warmup_num_steps", 1000))
    log = params.get("warmup_type", "log") == "log"
    frac = (math.log(it + 1) / math.log(w) if log else it / w) if 0 <= it < w else None
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        lo = params.get("warmup_min_ratio", 0.0)
        if frac is not None:
            return base * (lo + frac * (1 - lo))
        end = params.get("cos_min_ratio", 1e-4)
        progress = min(1.0, (it - w + 1) / max(1, params["total_num_steps"] - w))
        return base * (end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress)))
    lo = params.get("warmup_min_lr", 0.0)
    hi = params.get("warmup_max_lr", base if kind == "WarmupLR" else 1e-3)
    if it < 0:
        return lo
    if frac is not None:
        return lo + (hi - lo) * frac
    if kind == "WarmupLR":
        return hi
    total = params["total_num_steps"]
    return lo + (hi - lo) * max(0.0, (total - it) / max(1, total - w))


def plain_torch(ds, steps):
    """One process, whole batch, torch AdamW on every parameter, DeepSpeed's lr and clipping."""
    model = make(torch.float64)
    p = ds["optimizer"]["params"]
    opt = torch.optim.AdamW(model.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
    sch = ds.get("scheduler")
    for s in range(steps):
        if sch:
            for g in opt.param_groups:
                g["lr"] = ds_schedule_lr(sch["type"], sch["params"], s - 1, p["lr"])
        x, y = batch(s, torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        if ds.get("gradient_clipping", 1.0):  # DeepSpeed's default: 1.0
            torch.nn.utils.clip_grad_norm_(model.parameters(), ds.get("gradient_clipping", 1.0))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_steps(engine, rank, steps, dtype):
    ga = engine.gradient_accumulation_steps() if hasattr(engine, "gradient_accumulation_steps") else engine.accumulation
    per = G // 2 // ga
    for s in range(steps):
        x, y = batch(s, dtype)
        for m in range(ga):
            rows = slice(rank * G // 2 + m * per, rank * G // 2 + (m + 1) * per)
            engine.backward(((engine(x[rows]) - y[rows]) ** 2).mean())
            engine.step()


CASES = [  # (name, scheduler, gradient_clipping)
    ("constant, clipping off", None, 0.0),
    ("WarmupLR log, default clipping", {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_min_lr": 1e-3}}, None),
    ("WarmupDecayLR linear, clip", {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 2, "total_num_steps": 8, "warmup_max_lr": 3e-2, "warmup_type": "linear"}}, 0.05),
    ("WarmupCosineLR", {"type": "WarmupCosineLR", "params": {
        "warmup_num_steps": 3, "total_num_steps": 12, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2}}, None),
]
STEPS = 10
DS_CASES = [(stage, CASES[i]) for stage in range(4) for i in (stage, (stage + 2) % 4)]
"""The cases run through DeepSpeed itself (each deepspeed.initialize takes seconds on CPU): every
stage with two of them, one of them clipping (cases 1 and 2 alternate over the stages), and every
schedule at two stages, ZeRO-3 among them for two. The plain-torch reference runs them all."""


def _shardlab_worker(ctx):
    out = {}
    for stage in range(4):
        for name, sch, clip in CASES:
            engine = shardlab.initialize(make(torch.float64), ds_config(stage, sch, clip))
            run_steps(engine, ctx.rank, STEPS, torch.float64)
            out[(stage, name)] = engine.full_state_dict(everywhere=True)
    return out


def test_deepspeed_json_through_initialize_equals_plain_torch():
    """Every ZeRO stage, every scheduler, clipping on and off: no shardlab default leaks in."""
    got = launch.run(_shardlab_worker, 2, timeout_s=120)[0]
    for name, sch, clip in CASES:
        ref = plain_torch(ds_config(0, sch, clip), STEPS)
        for stage in range(4):
            for k, v in ref.items():
                assert (got[(stage, name)][k] - v).abs().max() <= PARITY_ATOL, (stage, name, k)


def test_param_groups_follow_the_user_not_the_llm_convention():
    """model_parameters as torch param groups: each group's weight decay and lr on exactly its
    parameters, at ZeRO 0-3, with a shardlab config and with a DeepSpeed JSON (where the groups'
    own weight decay wins over the JSON's decay-every-parameter default)."""
    got = launch.run(_groups_worker, 2, timeout_s=60)[0]
    model = make(torch.float64)
    opt = torch.optim.AdamW(_groups(model), lr=2e-2)
    for s in range(3):
        x, y = batch(s, torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    for stage in range(4):
        for k, v in model.state_dict().items():
            assert (got[stage][k] - v).abs().max() <= PARITY_ATOL, (stage, k)
    model = make(torch.float64)  # the JSON's optimizer settings are the groups' defaults, as in torch
    opt = torch.optim.AdamW(_groups(model, 5e-3), lr=2e-2, weight_decay=0.05)
    for s in range(STEPS):
        x, y = batch(s, torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    for stage in range(4):
        for k, v in model.state_dict().items():
            assert (got["ds", stage][k] - v).abs().max() <= PARITY_ATOL, ("ds", stage, k)


def _groups(model, lr=1e-2):
    """Two groups across the engines' own decay split (a bias and matrices in one, a norm, a bias
    and matrices in the other): under ZeRO each group gets flats of its own."""
    first = {"conv.weight", "conv.bias", "fc.weight"}
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in first], "weight_decay": 0.3},
            {"params": [p for n, p in named if n not in first], "weight_decay": 0.0, "lr": lr}]


def _groups_worker(ctx):
    out = {}
    for stage in range(4):
        model = make(torch.float64)
        cfg = {"parallel": {"zero_stage": stage, "wrap_policy": "blocks"},
               "train": {"precision": "fp64", "lr": 2e-2, "grad_clip": 0.0, "warmup_steps": 0, "min_lr_ratio": 1.0,
                         "beta2": 0.999, "device": "cpu", "global_batch": G}}
        engine = shardlab.initialize(model, cfg, model_parameters=_groups(model))
        run_steps(engine, ctx.rank, 3, torch.float64)
        out[stage] = engine.full_state_dict(everywhere=True)
        model = make(torch.float64)  # the same groups with a DeepSpeed JSON (whose decay is on every parameter)
        engine = shardlab.initialize(model, ds_config(stage, clip=0.05), model_parameters=_groups(model, 5e-3))
        run_steps(engine, ctx.rank, STEPS, torch.float64)
        out["ds", stage] = engine.full_state_dict(everywhere=True)
    return out


# -- against DeepSpeed itself ---------------------------------------------------------------------

def _import_deepspeed(rank):
    """deepspeed on its CPU accelerator, with its compiled ops marked unavailable. On the CPU its
    communication backend JIT-builds a C++ shared-memory op at the first ``initialize`` (about 60 s
    and 110 CPU-seconds on the 2-core host, every fresh clone: the build cache is keyed by the
    venv's paths), used only by ``inference_all_reduce``; training's collectives are
    torch.distributed's either way (deepspeed/comm/torch.py), so the engine's arithmetic is the same."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed reads its launch contract from the env
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__ = {}  # what its probe would have cached: every op is then skipped
    return deepspeed


def _deepspeed_worker(ctx):
    deepspeed = _import_deepspeed(ctx.rank)
    out = {}
    for stage, (name, sch, clip) in DS_CASES:
        ds = ds_config(stage, sch, clip)
        engine, *_ = deepspeed.initialize(model=make(torch.float32), config=ds,
                                          model_parameters=None)
        run_steps(engine, ctx.rank, STEPS, torch.float32)
        mine = shardlab.initialize(make(torch.float32), ds)
        run_steps(mine, ctx.rank, STEPS, torch.float32)
        if stage == 3:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                theirs = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        else:
            theirs = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        out[(stage, name)] = (theirs, mine.full_state_dict(everywhere=True))
    return out


def test_same_json_through_deepspeed_and_shardlab():
    pytest.importorskip("deepspeed")
    assert {st for st, _ in DS_CASES} == set(range(4)) and {c[0] for _, c in DS_CASES} == {c[0] for c in CASES}
    assert all({1, 2} & {CASES.index(c) for st, c in DS_CASES if st == stage} for stage in range(4))
    got = launch.run(_deepspeed_worker, 2, timeout_s=300)[0]
    assert len(got) == len(DS_CASES) == 8
    for (stage, name), (theirs, mine) in got.items():
        for k, v in theirs.items():
            assert (mine[k] - v).abs().max() <= 2e-6, (stage, name, k, float((mine[k] - v).abs().max()))


GROUP_CASES = [("two groups, clip 0.05", None, 0.05), CASES[3]]  # WarmupCosineLR: ratios of each group's lr


def _deepspeed_groups_worker(ctx):
    """Two param groups with their own weight decay and lr, through deepspeed.initialize and
    shardlab.initialize (model_parameters=...), the same JSON, ZeRO 0-3, 10 steps, fp32."""
    deepspeed = _import_deepspeed(ctx.rank)
    out = {}
    for stage in range(4):
        for name, sch, clip in GROUP_CASES:
            ds, theirs_model = ds_config(stage, sch, clip), make(torch.float32)
            engine, *_ = deepspeed.initialize(model=theirs_model, config=ds, model_parameters=_groups(theirs_model, 5e-3))
            run_steps(engine, ctx.rank, STEPS, torch.float32)
            mine_model = make(torch.float32)
            mine = shardlab.initialize(mine_model, ds, model_parameters=_groups(mine_model, 5e-3))
            run_steps(mine, ctx.rank, STEPS, torch.float32)
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
                theirs = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
            out[(stage, name)] = (theirs, mine.full_state_dict(everywhere=True), make(torch.float32).state_dict())
    return out


def test_param_groups_through_deepspeed_and_shardlab():
    """Parameters equal to 2e-6 (fp32; what 10 AdamW steps' rounding leaves), and both moved away
    from the initial values by far more (the groups' settings took effect)."""
    pytest.importorskip("deepspeed")
    got = launch.run(_deepspeed_groups_worker, 2, timeout_s=300)[0]
    for (stage, name), (theirs, mine, init) in got.items():
        for k, v in theirs.items():
            assert (mine[k] - v).abs().max() <= 2e-6, (stage, name, k, float((mine[k] - v).abs().max()))
            assert (v - init[k]).abs().max() > 1e-3, (stage, name, k)


def test_param_groups_that_split_a_flat_shard_are_refused():
    from shardlab.errors import ConfigError
    from shardlab.train.groups import regroup, user_groups

    class Flat:  # what a ZeRO engine packs: the norm and the biases share a flat shard
        names, shard = ["norm.weight", "fc.bias"], nn.Parameter(torch.zeros(2))
    model = make(torch.float64)
    groups = user_groups(model, [{"params": [model.norm.weight], "weight_decay": 0.1},
                                 {"params": [p for n, p in model.named_parameters() if n != "norm.weight"]}])
    ids = {n: id(p) for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="norm.weight, fc.bias into one flat shard"):
        regroup([{"params": [Flat.shard]}], groups, ids, [Flat], 0.0)
    with pytest.raises(ConfigError, match="leaves out conv.weight"):
        user_groups(model, [p for n, p in model.named_parameters() if n != "conv.weight"])
