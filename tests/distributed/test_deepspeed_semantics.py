"""What a DeepSpeed script observes, through ``deepspeed.initialize`` (0.19.8, CPU accelerator)
and ``shardlab.initialize`` side by side on 2 ranks, the same calls (docs/deepspeed.md, A DeepSpeed
script unchanged): the lr the optimizer used where the engine must not write it, a class or a
factory as ``optimizer=``, the accumulation boundary, ``was_step_applied`` and ``backward``'s
value at every point of the loop, ``no_sync`` / ``zero_grad`` / ``set_gradient_accumulation_boundary``,
untagged saves, a load without the scheduler's state, frozen parameters left out of a save,
``deepspeed_io``'s keywords and the engine's accessors. Each was a silent difference found by
an audit on 2026-12-08 (before: shardlab overwrote a hand-set lr every step, called a class
with its own lr and weight decay, said ``was_step_applied()`` on every micro-batch, ...)."""
import os

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import SequentialSampler

import shardlab
from shardlab import launch
from shardlab.errors import ConfigError
from tests.distributed.test_deepspeed_parity import _import_deepspeed, batch, make
from tests.distributed.test_deepspeed_script import Samples, full_params

pytestmark = pytest.mark.skipif(not __import__("importlib").util.find_spec("deepspeed"), reason="needs deepspeed")
ATOL = 2e-6  # fp32, a few AdamW steps' rounding (tests/distributed/test_deepspeed_parity.py)


def json_cfg(stage=0, ga=1, **extra):
    return {"train_micro_batch_size_per_gpu": 4 // ga, "gradient_accumulation_steps": ga, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, **extra}


def micro(engine, step, rank, m=0, ga=1):
    """This rank's ``m``-th micro-batch of optimizer step ``step``: its loss (not yet backward)."""
    x, y = batch(step, torch.float32)
    per = 4 // ga
    rows = slice(4 * rank + m * per, 4 * rank + (m + 1) * per)
    return F.mse_loss(engine(x[rows]), y[rows])


def both(ctx, fn):
    """``fn(lib, deepspeed_or_None)`` through DeepSpeed, then shardlab: (theirs, mine)."""
    deepspeed = _import_deepspeed(ctx.rank)
    return fn(deepspeed, deepspeed), fn(shardlab, None)


# -- the lr and the optimizer ------------------------------------------------------------------

def _lr_run(lib, deepspeed, stage, mode):
    net = make(torch.float32)
    engine, opt, _, sched = lib.initialize(model=net, config=json_cfg(stage), model_parameters=net.parameters())
    used = []
    getattr(engine, "basic_optimizer", engine.optimizer).register_step_pre_hook(
        lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    mine = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** (k + 1)) if mode == "LambdaLR" else None
    for s in range(4):
        if mode == "hand":
            for g in opt.param_groups:
                g["lr"] = 1e-3 * (s + 1)
        engine.backward(micro(engine, s, engine.global_rank))
        engine.step()
        if mine is not None:
            mine.step()
    return {"used": used, "sched": sched, "params": full_params(engine, deepspeed)}


def _optimizer_run(lib, deepspeed, stage, which):
    net = make(torch.float32)
    extra = {"optimizer": {"type": "AdamW", "params": {"lr": 5e-2, "weight_decay": 0.3, "torch_adam": True}}}
    named = dict(net.named_parameters())
    groups = [{"params": [named["fc.weight"], named["conv.weight"]], "weight_decay": 0.2},
              {"params": [p for n, p in named.items() if n not in ("fc.weight", "conv.weight")], "lr": 2e-2}]
    kwargs = {"class": dict(optimizer=torch.optim.AdamW, model_parameters=groups),
              "factory": dict(optimizer=lambda ps: torch.optim.SGD(ps, lr=5e-2, momentum=0.9),
                              model_parameters=net.parameters()),
              "object + model_parameters": dict(optimizer=torch.optim.AdamW(net.parameters(), lr=1e-2),
                                                model_parameters=net.parameters())}[which]
    extra["zero_allow_untested_optimizer"] = True  # DeepSpeed's ZeRO takes SGD only with it
    engine, opt, _, _ = lib.initialize(model=net, config=dict(json_cfg(stage), **extra), **kwargs)
    settings = sorted((g["lr"], g["weight_decay"]) for g in opt.param_groups)
    for s in range(3):
        engine.backward(micro(engine, s, engine.global_rank))
        engine.step()
    return {"groups": settings, "name": engine.optimizer_name(), "mom": engine.get_mom(),
            "params": full_params(engine, deepspeed)}


def _optimizer_worker(ctx):
    def fn(lib, deepspeed):
        out = {("lr", stage, mode): _lr_run(lib, deepspeed, stage, mode)
               for stage, mode in ((0, "hand"), (2, "hand"), (0, "LambdaLR"))}
        for stage in (0, 2):
            for which in ("class", "factory", "object + model_parameters"):
                out["opt", stage, which] = _optimizer_run(lib, deepspeed, stage, which)
        return out
    return both(ctx, fn)


def _close(a, b):
    return all((a[k] - v).abs().max() <= ATOL for k, v in b.items())


def test_the_lr_and_the_optimizer_are_yours_as_in_deepspeed():
    """A JSON with an ``optimizer`` block and no ``scheduler``: the lr set by hand in the returned
    optimizer's groups, or by your LambdaLR on it, is the lr each step uses (the engine wrote the
    JSON's over it every step before). ``optimizer=`` a class or a factory: called with
    ``model_parameters`` alone (no lr or weight decay of the config, the JSON block ignored);
    an object with ``model_parameters`` too: the object wins (was refused). ZeRO 0 and 2."""
    for theirs, mine in launch.run(_optimizer_worker, 2, timeout_s=300):
        for key, want in theirs.items():
            got = mine[key]
            assert _close(got["params"], want["params"]), key
            if key[0] == "lr":
                assert got["used"] == pytest.approx(want["used"], rel=1e-12) and got["sched"] is want["sched"] is None
                assert len(set(got["used"])) == 4, got["used"]  # the lr moved every step (never the JSON's 1e-2)
            else:
                assert (got["groups"], got["name"], got["mom"]) == (want["groups"], want["name"], want["mom"]), key
        assert theirs["opt", 0, "class"]["groups"] == [(1e-3, 0.2), (2e-2, 0.01)]  # AdamW's defaults where unset
        assert theirs["opt", 0, "factory"]["name"] == "function"  # DeepSpeed's __class__.__name__ of the callable


# -- the loop: boundary, was_step_applied, backward, no_sync, zero_grad -----------------------------

def _loop_run(lib, ga):
    engine, *_ = lib.initialize(model=make(torch.float32), config=json_cfg(0, ga))
    seen = []
    for i in range(4):
        before = engine.is_gradient_accumulation_boundary()
        loss = micro(engine, i // ga, engine.global_rank, i % ga, ga)
        ret = engine.backward(loss)
        after = engine.is_gradient_accumulation_boundary()
        engine.step()
        seen.append((before, after, engine.is_gradient_accumulation_boundary(), engine.was_step_applied(),
                     float(ret) / float(loss), engine.micro_steps, engine.global_steps, engine.global_samples,
                     engine.skipped_steps))
    return seen


def _manual_run(lib, deepspeed, stage, how):
    """Accumulation driven by the script: set_gradient_accumulation_boundary, no_sync, zero_grad."""
    ga = 1 if how == "no_sync" else 2
    engine, *_ = lib.initialize(model=make(torch.float32), config=json_cfg(stage, ga))
    r = engine.global_rank
    for s in range(2):
        if how == "boundary":  # DeepSpeed's docstring example: one step() after the last backward
            engine.set_gradient_accumulation_boundary(False)
            engine.backward(micro(engine, s, r, 0, 2))
            engine.set_gradient_accumulation_boundary(True)
            engine.backward(micro(engine, s, r, 1, 2))
        elif how == "no_sync":  # two micro-batches accumulate locally, the third reduces all three
            with engine.no_sync():
                for m in range(2):
                    engine.backward(micro(engine, s, r, m, 4))
            engine.backward(micro(engine, s, r, 2, 4))
        else:  # zero_grad after the first micro-batch: the step has the second's gradient alone
            engine.backward(micro(engine, s, r, 0, 2))
            engine.step()
            engine.zero_grad()
            engine.backward(micro(engine, s, r, 1, 2))
        engine.step()
    return full_params(engine, deepspeed), engine.global_steps


def _refused(engine):
    try:
        with engine.no_sync():
            pass
    except (AssertionError, ConfigError) as e:
        return type(e).__name__
    return None


def _loop_worker(ctx):
    def fn(lib, deepspeed):
        out = {("loop", ga): _loop_run(lib, ga) for ga in (1, 2)}
        for stage, how in ((0, "boundary"), (2, "boundary"), (0, "no_sync"), (1, "no_sync"), (0, "zero_grad")):
            out[how, stage] = _manual_run(lib, deepspeed, stage, how)
        engine, *_ = lib.initialize(model=make(torch.float32), config=json_cfg(2))
        out["no_sync at stage 2"] = _refused(engine)
        return out
    return both(ctx, fn)


def test_the_training_loop_observes_what_deepspeed_s_does():
    """At every point of 4 micro-batches (accumulation 1 and 2): ``is_gradient_accumulation_boundary()``
    before the forward, after ``backward`` and after ``step`` (DeepSpeed counts micro-steps in
    ``step()``: True after the boundary's backward, always at accumulation 1), ``was_step_applied()``
    (False between boundaries), ``backward``'s value (the loss / accumulation), ``micro_steps``,
    ``global_steps``, ``global_samples``, ``skipped_steps``: equal. A script driving the
    accumulation itself (set_gradient_accumulation_boundary at ZeRO 0 and 2, no_sync at ZeRO 0
    and 1, zero_grad at ZeRO 0): parameters equal to 2e-6; no_sync at ZeRO-2 refused by both."""
    for theirs, mine in launch.run(_loop_worker, 2, timeout_s=300):
        for ga in (1, 2):
            assert mine["loop", ga] == theirs["loop", ga], (ga, mine["loop", ga], theirs["loop", ga])
        assert [s[3] for s in mine["loop", 2]] == [False, True, False, True]
        for key in (("boundary", 0), ("boundary", 2), ("no_sync", 0), ("no_sync", 1), ("zero_grad", 0)):
            (want, want_steps), (got, got_steps) = theirs[key], mine[key]
            assert got_steps == want_steps == 2 and _close(got, want), key
        assert (theirs["no_sync at stage 2"], mine["no_sync at stage 2"]) == ("AssertionError", "ConfigError")
        assert not _close(theirs["zero_grad", 0][0], theirs["boundary", 0][0])  # zero_grad changed the result


# -- checkpoints ----------------------------------------------------------------------------------

def _ckpt_run(lib, deepspeed, tmp):
    r, out = torch.distributed.get_rank(), {}
    warm = json_cfg(0, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}})
    engine, *_ = lib.initialize(model=make(torch.float32), config=warm)
    for s in range(5):
        engine.backward(micro(engine, s, r))
        engine.step()
        out.setdefault("saved", []).append(bool(engine.save_checkpoint(tmp)))  # untagged: global_step{N}
    torch.distributed.barrier()
    out["listing"] = sorted(os.listdir(tmp))
    out["latest"] = (tmp / "latest").read_text().strip()
    torch.distributed.barrier()  # every rank has looked before the next save writes
    engine.save_checkpoint(tmp, tag="other", save_latest=False)
    torch.distributed.barrier()
    out["latest after save_latest=False"] = (tmp / "latest").read_text().strip()
    for name, kwargs in (("no scheduler", {"load_lr_scheduler_states": False}),
                         ("no optimizer", {"load_optimizer_states": False})):
        fresh, *_ = lib.initialize(model=make(torch.float32), config=warm)
        fresh.load_checkpoint(tmp, tag="global_step5", **kwargs)
        lrs = []
        for s in range(3):
            lrs.append(fresh.get_lr()[0])
            fresh.backward(micro(fresh, s, r))
            fresh.step()
        out[name] = (fresh.global_steps, lrs)
    net = make(torch.float32)
    net.norm.requires_grad_(False)  # frozen, left out of the save
    engine, *_ = lib.initialize(model=net, config=json_cfg(0), model_parameters=[p for p in net.parameters()
                                                                                  if p.requires_grad])
    engine.backward(micro(engine, 0, r))
    engine.step()
    engine.save_checkpoint(tmp / "frozen", exclude_frozen_parameters=True)
    net = make(torch.float32)
    with torch.no_grad():
        net.norm.weight.fill_(3.0)  # a different frozen base: the load keeps it
    net.norm.requires_grad_(False)
    fresh, *_ = lib.initialize(model=net, config=json_cfg(0), model_parameters=[p for p in net.parameters()
                                                                                 if p.requires_grad])
    try:
        fresh.load_checkpoint(tmp / "frozen")
        out["strict"] = None
    except (RuntimeError, ConfigError) as e:
        out["strict"] = type(e).__name__
    fresh.load_checkpoint(tmp / "frozen", load_module_strict=False)
    out["frozen"] = (full_params(fresh, deepspeed), full_params(engine, deepspeed))
    return out


def _ckpt_worker(ctx, tmp):
    return both(ctx, lambda lib, deepspeed: _ckpt_run(lib, deepspeed, tmp / lib.__name__))


def test_checkpoints_as_deepspeed_writes_and_reads_them(tmp_path):
    """Untagged saves after each of 5 steps: ``global_step1`` .. ``global_step5`` and ``latest``, none
    deleted (shardlab wrote ``step_NNNNNNNN`` and kept 3); ``save_latest=False`` leaves ``latest``.
    A load without the scheduler's state: ``global_steps`` loaded, the optimizer's lr for one step,
    then a fresh warm-up (the lr went on from the loaded step before); without the optimizer's
    state: the same lrs as DeepSpeed's. ``exclude_frozen_parameters``: a strict load refused by
    both, a non-strict one keeps the fresh engine's frozen weight and loads the rest."""
    for theirs, mine in launch.run(_ckpt_worker, 2, tmp_path, timeout_s=300):
        assert mine["saved"] == theirs["saved"] == [True] * 5
        assert mine["listing"] == theirs["listing"] == [f"global_step{k}" for k in range(1, 6)] + ["latest"]
        assert mine["latest"] == theirs["latest"] == mine["latest after save_latest=False"] == "global_step5"
        assert theirs["latest after save_latest=False"] == "global_step5"
        for name in ("no scheduler", "no optimizer"):
            assert mine[name][0] == theirs[name][0] == 8, name
            assert mine[name][1] == pytest.approx(theirs[name][1], rel=1e-12, abs=1e-15), (name, mine[name], theirs[name])
        assert mine["no scheduler"][1] == pytest.approx([4e-3, 0.0, 1e-3])  # loaded lr, then warm-up from 0
        assert theirs["strict"] == "RuntimeError" and mine["strict"] == "ConfigError"
        (got, saved), (want, _) = mine["frozen"], theirs["frozen"]
        assert _close(got, want) and torch.equal(got["norm.weight"], torch.full_like(got["norm.weight"], 3.0))
        assert torch.equal(got["fc.weight"], saved["fc.weight"])


# -- deepspeed_io and the accessors -----------------------------------------------------------------

def _collate(rows):
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), [-r[2] for r in rows]


def _io_run(lib):
    cfg = json_cfg(0, dataloader_drop_last=True, gradient_clipping=0.5, steps_per_print=7)
    net = make(torch.float32)
    engine, _, loader, _ = lib.initialize(model=net, config=cfg, training_data=Samples(), collate_fn=_collate)
    data = Samples()

    def indices(dl):
        return [[int(i) for i in b[2]] for b in dl]
    out = {"train": indices(loader), "io": indices(engine.deepspeed_io(data, num_local_io_workers=0)),
           "eval": indices(engine.deepspeed_io(data, route="eval", num_local_io_workers=0)),
           "batch 3": indices(engine.deepspeed_io(data, batch_size=3, num_local_io_workers=0)),
           "sampler": indices(engine.deepspeed_io(data, data_sampler=SequentialSampler(data), num_local_io_workers=0))}
    out["accessors"] = (engine.dataloader_drop_last(), engine.gradient_clipping(), engine.steps_per_print(),
                        engine.loss_scale(), engine.optimizer_name(), engine.get_mom(), engine.dp_world_size)
    engine.set_train_batch_size(24)
    out["batch 24"] = (engine.train_batch_size(), engine.gradient_accumulation_steps(),
                       engine.train_micro_batch_size_per_gpu())
    engine.set_train_micro_batch_size(2)
    out["micro 2"] = (engine.train_batch_size(), engine.gradient_accumulation_steps(),
                      engine.train_micro_batch_size_per_gpu())
    return out


def _io_worker(ctx):
    return both(ctx, lambda lib, deepspeed: _io_run(lib))


def test_deepspeed_io_and_accessors_as_deepspeed():
    """``deepspeed_io`` with the JSON's ``dataloader_drop_last`` (shardlab kept the short batch),
    ``route="eval"`` (in order), ``batch_size``, ``data_sampler``, initialize's ``collate_fn`` by
    default: the same sample indices in every batch of every rank; and ``dataloader_drop_last()``,
    ``gradient_clipping()``, ``steps_per_print()``, ``loss_scale()``, ``optimizer_name()``,
    ``get_mom()``, ``dp_world_size``, ``set_train_batch_size`` / ``set_train_micro_batch_size``."""
    for theirs, mine in launch.run(_io_worker, 2, timeout_s=300):
        assert mine == theirs, {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
        assert len(mine["io"]) == 4 and all(len(b) == 4 for b in mine["io"])  # 19 a rank: the short batch dropped
        assert all(i <= 0 for b in mine["io"] for i in b)  # initialize's collate_fn (it negates the index)
        assert mine["eval"] == sorted(mine["eval"], reverse=True)
        assert mine["accessors"][:5] == (True, 0.5, 7, 0, "adamw") and mine["batch 24"] == (24, 3, 4)
