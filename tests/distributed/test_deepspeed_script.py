"""A DeepSpeed training script as DeepSpeed's tutorials write it (``args`` from argparse with
``--deepspeed_config``, ``model_parameters``, ``training_data``, the four returned values,
``_, client_sd = engine.load_checkpoint(...)``), run once with ``deepspeed.initialize`` and once
with ``shardlab.initialize``, nothing else changed: the same batches on every rank, the same lr
read from the returned scheduler, the same parameters after training (fp32, 2e-6) and after a
load, the same client state (docs/deepspeed.md, A DeepSpeed script unchanged)."""
import argparse
import json
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import shardlab
from shardlab import launch
from shardlab.errors import ConfigError
from tests.distributed.test_deepspeed_parity import D_IN, _import_deepspeed, batch, make

N_SAMPLES = 38  # 19 a rank: four micro-batches of 4 and a short one of 3 (dropped with dataloader_drop_last)
JSONS = {
    "zero2, WarmupLR, drop_last": {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "dataloader_drop_last": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.05, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2}, "steps_per_print": 10**9},
    "zero0, constant lr": {
        "train_batch_size": 8, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 0}, "steps_per_print": 10**9},
}


class Samples(Dataset):
    """Rows with their index, so the test sees which samples each rank was given."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N_SAMPLES, D_IN, generator=g)
        self.y = (4 * self.x.sum(1, keepdim=True).cos())

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def full_params(engine, deepspeed):
    """The engine's parameters, unsharded, on every rank."""
    if deepspeed is None:
        return engine.full_state_dict(everywhere=True)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def script(lib, json_path, ckpt, deepspeed=None):
    """The user's script: ``lib`` is ``deepspeed`` or ``shardlab`` (``import shardlab as deepspeed``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    lib.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed_config", str(json_path)])
    lib.init_distributed()  # joins the job the launcher started (here: already joined)
    net = make(torch.float32)
    engine, optimizer, loader, sched = lib.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                      training_data=Samples())
    flags = [engine.zero_optimization_stage(), engine.bfloat16_enabled(), engine.fp16_enabled(),
             engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), engine.train_batch_size()]
    seen, lrs = [], []
    for epoch in range(2):
        loader.data_sampler.set_epoch(epoch)
        for x, y, index in loader:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            seen.append(index.tolist())
            lrs.append(None if sched is None else list(sched.get_last_lr()))
    trained = full_params(engine, deepspeed)
    engine.save_16bit_model(ckpt / "export")  # every rank calls it, as in DeepSpeed
    exported = torch.load(ckpt / "export" / "pytorch_model.bin") if engine.global_rank == 0 else None
    engine.save_checkpoint(ckpt, tag=f"global_step{engine.global_steps}", client_state={"epoch": 2})
    if hasattr(engine, "wait_checkpoint"):
        engine.wait_checkpoint()
    args.local_rank = -1
    net = make(torch.float32)
    again, *_ = lib.initialize(args=args, model=net, model_parameters=net.parameters())
    path, client = again.load_checkpoint(ckpt)
    return {"seen": seen, "lrs": lrs, "local_rank": args.local_rank, "batches": len(loader),
            "optimizer_lr": [g["lr"] for g in optimizer.param_groups], "scheduler": sched is not None,
            "trained": trained, "loaded": full_params(again, deepspeed), "client": client,
            "path": path is not None, "steps": engine.global_steps, "flags": flags, "exported": exported}


def _worker(ctx, tmp):
    deepspeed = _import_deepspeed(ctx.rank)
    out = {}
    for name, ds in JSONS.items():
        path = tmp / f"{name.split(',')[0]}.json"
        if ctx.rank == 0:
            path.write_text(json.dumps(ds))
        torch.distributed.barrier()
        theirs = script(deepspeed, path, tmp / f"ds-{path.stem}", deepspeed)
        mine = script(shardlab, path, tmp / f"sl-{path.stem}")
        out[name] = theirs, mine
    return out


def test_a_deepspeed_script_runs_unchanged(tmp_path):
    pytest.importorskip("deepspeed")
    got = launch.run(_worker, 2, tmp_path, timeout_s=300)
    for rank, results in enumerate(got):
        for name, (theirs, mine) in results.items():
            for key in ("seen", "local_rank", "batches", "scheduler", "path", "steps", "flags"):
                assert mine[key] == theirs[key], (rank, name, key, mine[key], theirs[key])
            assert mine["local_rank"] == rank and mine["path"]
            # DeepSpeed's client_sd also holds its own extra keys (ds_config, ds_version, ...): yours, equal
            assert mine["client"] == {"epoch": 2} and theirs["client"]["epoch"] == 2, sorted(theirs["client"])
            drop = JSONS[name].get("dataloader_drop_last", False)
            assert mine["batches"] == (4 if drop else 5) and len(mine["seen"]) == 2 * mine["batches"]
            assert sorted(i for b in mine["seen"] for i in b) != list(range(N_SAMPLES))  # a rank's share
            for a, b in zip(mine["lrs"] + [mine["optimizer_lr"]], theirs["lrs"] + [theirs["optimizer_lr"]]):
                assert a == b or max(abs(u - v) for u, v in zip(a, b)) <= 1e-12, (name, mine["lrs"], theirs["lrs"])
            for k, v in theirs["trained"].items():
                assert (mine["trained"][k] - v).abs().max() <= 2e-6, (name, k)
                assert torch.equal(mine["loaded"][k], mine["trained"][k]), (name, k)
                assert torch.equal(theirs["loaded"][k], v), (name, k)
            if rank == 0:  # save_16bit_model: the same keys, dtypes and values (fp32 runs save fp32, as DeepSpeed)
                assert mine["exported"].keys() == theirs["exported"].keys() == theirs["trained"].keys()
                for k, v in theirs["exported"].items():
                    assert mine["exported"][k].dtype == v.dtype and (mine["exported"][k] - v).abs().max() <= 2e-6
    both = [i for r in got for b in r["zero0, constant lr"][1]["seen"][:5] for i in b]
    assert sorted(both) == list(range(N_SAMPLES))  # one epoch: every sample once over the two ranks


def objects_script(lib, stage, rank, deepspeed=None):
    """The other common DeepSpeed call: your optimizer object (two groups) and a scheduler built on
    it (``lr_scheduler=``, stepped by the engine), then lr set by hand in your optimizer's groups."""
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    rows = slice(4 * rank, 4 * rank + 4)
    net = make(torch.float32)
    decay = [p for p in net.parameters() if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0.0}], lr=2e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    engine, _, _, returned_sched = lib.initialize(model=net, optimizer=opt, lr_scheduler=sched, config=ds)

    def train(engine, opt, steps, hand_lr_at=None):
        """``steps`` steps on this rank's rows; the lr of ``opt``'s groups after each."""
        lrs = []
        for step in range(steps):
            if step == hand_lr_at:
                for g in opt.param_groups:
                    g["lr"] = 1e-3
            x, y = batch(step, torch.float32)
            engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
            lrs.append([g["lr"] for g in opt.param_groups])
        return lrs
    lrs = train(engine, opt, 5)
    net = make(torch.float32)
    opt2 = torch.optim.AdamW(net.parameters(), lr=2e-2)
    by_hand, *_ = lib.initialize(model=net, optimizer=opt2, config=ds)
    train(by_hand, opt2, 4, hand_lr_at=2)
    net = make(torch.float32)  # your optimizer object with the JSON's scheduler block: DeepSpeed builds it on yours
    opt3 = torch.optim.AdamW([{"params": [p for p in net.parameters() if p.ndim >= 2], "lr": 2e-2},
                              {"params": [p for p in net.parameters() if p.ndim < 2], "lr": 5e-3}])
    json_sched, *_ = lib.initialize(model=net, optimizer=opt3, config=dict(ds, scheduler={
        "type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}}))
    json_lrs = train(json_sched, opt3, 4)
    return {"lrs": lrs + json_lrs, "same_scheduler": returned_sched is sched, "params": full_params(engine, deepspeed),
            "by_hand": full_params(by_hand, deepspeed), "json_sched": full_params(json_sched, deepspeed)}


def _objects_worker(ctx):
    deepspeed = _import_deepspeed(ctx.rank)
    return {stage: (objects_script(deepspeed, stage, ctx.rank, deepspeed), objects_script(shardlab, stage, ctx.rank))
            for stage in (0, 2, 3)}


def test_your_optimizer_and_scheduler_objects_as_in_deepspeed():
    """DeepSpeed keeps your optimizer object (its groups refilled with what it trains) and steps
    your scheduler after each step: the same lr sequence, parameters equal to 2e-6 (fp32), and an
    lr set by hand in your optimizer's groups takes effect (before 2026-12-07 shardlab rebuilt the
    optimizer from its class, so such an edit was silently lost, and refused a scheduler object)."""
    pytest.importorskip("deepspeed")
    for results in launch.run(_objects_worker, 2, timeout_s=300):
        for stage, (theirs, mine) in results.items():
            assert mine["lrs"] == theirs["lrs"] and mine["same_scheduler"] and theirs["same_scheduler"], stage
            assert mine["lrs"][0] != mine["lrs"][-1]  # the schedule moved
            for key in ("params", "by_hand", "json_sched"):
                for k, v in theirs[key].items():
                    assert (mine[key][k] - v).abs().max() <= 2e-6, (stage, key, k)
    net = make(torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-2)
    with pytest.raises(ConfigError, match="built on another optimizer"):
        shardlab.initialize(net, {"train": {"steps": 2}}, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    engine, optimizer, *_ = shardlab.initialize(net, {"train": {"steps": 2}}, optimizer=opt)
    assert optimizer is opt and engine.optimizer is opt  # the same object, now holding the engine's tensors


def test_deepspeed_arguments_refused_by_name(tmp_path):
    net = nn.Linear(D_IN, 1)
    ds = {"train_batch_size": 2}
    for kwargs, field in [({"model": argparse.Namespace()}, "model"), ({"model": None}, "model"),
                          ({"model": net, "mpu": object()}, "mpu"),
                          ({"model": net, "config": ds, "args": argparse.Namespace(deepspeed_config="x.json")},
                           "args.deepspeed_config"),
                          ({"model": net, "config": ds, "training_data": [1, 2]}, "training_data"),
                          ({"model": net, "config": ds, "collate_fn": list}, "collate_fn"),
                          ({"model": net, "config": dict(ds, dataloader_drop_last="yes")}, "dataloader_drop_last")]:
        with pytest.raises(ConfigError) as e:
            shardlab.initialize(**kwargs)
        assert e.value.field == field, (kwargs, e.value)
    args = shardlab.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed"])
    assert args.deepspeed and args.deepspeed_config is None and args.deepscale_config is None
    with pytest.raises(ConfigError, match="dist_backend"):
        shardlab.init_distributed("mpi")
    engine, optimizer, loader, sched = shardlab.initialize(args=args, config_params=ds, model=net)  # older name
    assert loader is None and sched is None and optimizer is engine.optimizer and engine.train_batch_size() == 2
    engine, _, _, sched = shardlab.initialize(net, {"train": {"warmup_steps": 2, "steps": 4, "lr": 1e-2}})
    assert sched.get_last_lr() == engine.get_lr() == [5e-3] * 2  # shardlab's cosine, warming up (two decay groups)
    engine.backward(engine(torch.randn(2, D_IN)).sum())
    engine.step()
    assert engine.get_lr() == sched.get_last_lr() == [1e-2] * 2  # the next step's, as DeepSpeed's
    with pytest.raises(ConfigError, match="engine.step\\(\\) advances it"):
        sched.step()


def test_save_16bit_model_casts_under_bf16_and_can_leave_frozen_out(tmp_path):
    net = make(torch.float32)
    net.norm.weight.requires_grad_(False)
    ds = {"train_batch_size": 8, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = shardlab.initialize(model=net, config=ds)
    x, y = batch(0, torch.float32)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert engine.save_16bit_model(tmp_path, "m.bin", exclude_frozen_parameters=True) is True
    got, full = torch.load(tmp_path / "m.bin"), engine.full_state_dict()
    assert sorted(got) == sorted(k for k in full if k != "norm.weight") and not list(tmp_path.glob(".*"))
    for k, v in got.items():  # the fp32 master weights rounded to bf16, the 16-bit dtype DeepSpeed's module holds
        assert v.dtype == torch.bfloat16 and torch.equal(v, full[k].to(torch.bfloat16)), k


def _generate_worker(ctx):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        engine, *_ = shardlab.initialize(model=LlamaForCausalLM(cfg), config={
            "train_batch_size": 4, "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        fresh = LlamaForCausalLM(cfg)
        fresh.load_state_dict(engine.full_state_dict(everywhere=True))
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=ids).logits
            tokens = engine.module.generate(ids, max_new_tokens=4, do_sample=False)
            out[stage] = (sorted(n for n, _ in engine.module.named_parameters()) == sorted(n for n, _ in fresh.named_parameters()),
                          torch.equal(logits, fresh(input_ids=ids).logits),
                          torch.equal(tokens, fresh.generate(ids, max_new_tokens=4, do_sample=False)),
                          # nothing left gathered after generate; under ZeRO-3 the parameters are empty placeholders
                          getattr(engine.engine, "gathered_bytes", 0),
                          stage < 3 or all(p.numel() == 0 for p in engine.module.parameters()))
        engine.train()  # and training goes on after generate, with the same result as without it
        loss2 = engine(input_ids=ids, labels=ids).loss
        fresh.train()
        out[stage] += (abs(float(loss2) - float(fresh(input_ids=ids, labels=ids).loss)) < 1e-5,)
    return out


def test_generate_on_the_engines_module():
    """docs/api.md, engine.module: at ZeRO-2 and ZeRO-3 a transformers model's ``generate`` runs on
    the engine's module (tokens and logits equal to a fresh model loaded from full_state_dict), its
    ``named_parameters()`` are the model's (ZeRO-3: empty placeholders, as DeepSpeed's; before
    2026-12-07 none, and ``generate`` raised StopIteration), nothing stays gathered after it, and
    a training forward after it equals the fresh model's."""
    pytest.importorskip("transformers")
    for result in launch.run(_generate_worker, 2, timeout_s=120):
        for stage in (2, 3):
            assert result[stage] == (True, True, True, 0, True, True), (stage, result[stage])


def test_backward_takes_deepspeeds_arguments():
    """``engine.backward(loss, retain_graph=..., scale_wrt_gas=...)`` as DeepSpeed's: without the
    division by the accumulation steps an SGD step moves the weights twice as far at 2 steps; a
    kept graph can be differentiated again."""
    moved = {}
    for scale in (True, False):
        net = make(torch.float64)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        engine, *_ = shardlab.initialize(net, {"parallel": {"microbatches": 2}, "train": {
            "precision": "fp64", "grad_clip": 0.0, "global_batch": 8, "lr": 1e-2, "warmup_steps": 0,
            "min_lr_ratio": 1.0, "weight_decay": 0.0}}, optimizer=torch.optim.SGD)
        x, y = batch(0, torch.float64)
        x.requires_grad_(True)
        for i in range(2):
            loss = F.mse_loss(engine(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4])
            got = engine.backward(loss, retain_graph=True, scale_wrt_gas=scale)
            assert torch.equal(got, loss / 2 if scale else loss)  # DeepSpeed's return: the loss as scaled
            assert torch.autograd.grad(loss, x)[0].abs().sum() > 0  # the graph was kept
            engine.step()
        moved[scale] = {k: v - before[k] for k, v in engine.full_state_dict().items()}
    for k, v in moved[True].items():
        assert v.abs().max() > 1e-6 and torch.allclose(moved[False][k], 2 * v, rtol=1e-9, atol=1e-12), k


def _mid_accumulation_worker(ctx, tmp):
    out = {}
    for stage in (0, 2, 3):
        runs = {}
        for save in (False, True):
            net = make(torch.float64)
            engine, *_ = shardlab.initialize(net, {"parallel": {"microbatches": 2, "zero_stage": stage}, "train": {
                "precision": "fp64", "global_batch": 8, "lr": 1e-2, "warmup_steps": 0, "min_lr_ratio": 1.0}})
            for micro in range(4):  # steps after micro-batches 2 and 4; a save after the 3rd
                x, y = batch(micro, torch.float64)
                rows = slice(2 * ctx.rank, 2 * ctx.rank + 2)
                engine.backward(F.mse_loss(engine(x[rows]), y[rows]))
                engine.step()
                if micro == 1:
                    after_first = engine.full_state_dict(everywhere=True)
                if micro == 2 and save:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        engine.save_checkpoint(tmp / f"ck{stage}")
                    out[stage, "warned"] = [str(w.message) for w in caught]
            runs[save] = engine.full_state_dict(everywhere=True)
        fresh, *_ = shardlab.initialize(make(torch.float64), {"parallel": {"microbatches": 2, "zero_stage": stage},
                                                             "train": {"precision": "fp64", "global_batch": 8}})
        fresh.load_checkpoint(tmp / f"ck{stage}")
        out[stage] = runs[False], runs[True], after_first, fresh.full_state_dict(everywhere=True), fresh.global_steps
    return out


def test_a_save_in_the_middle_of_accumulation_as_in_deepspeed(tmp_path):
    """DeepSpeed saves where a script asks (an epoch of an odd number of micro-batches ends inside an
    accumulation); shardlab refused with a RuntimeError until 2026-12-07. Now it warns (rank 0) and
    saves the state after the last optimizer step, and the run it interrupts is unchanged."""
    for rank, out in enumerate(launch.run(_mid_accumulation_worker, 2, tmp_path, timeout_s=120)):
        for stage in (0, 2, 3):
            plain, saved, after_first, loaded, steps = out[stage]
            assert steps == 1 and (len(out[stage, "warned"]) == 1) == (rank == 0), (stage, out[stage, "warned"])
            for k, v in plain.items():
                assert torch.equal(saved[k], v), (stage, k)  # the save did not disturb the accumulation
                assert torch.equal(loaded[k], after_first[k]), (stage, k)  # it holds the state after step 1
