"""shardlab.initialize on a model shardlab has never seen: every data-parallel layout at N=2 and
N=4 equals a plain single-process torch AdamW loop (float64, <= 1e-10); a checkpoint resumed
by a fresh engine continues bit-exactly; bad inputs are one-line ConfigErrors; shardlab launch."""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import shardlab
from shardlab import launch
from shardlab.api import resolve_config
from shardlab.errors import ConfigError

PARITY_ATOL = 1e-10  # the parity bar (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
G, STEPS, SAVE_AT, LR, CLIP, WD = 8, 4, 2, 2e-2, 0.3, 0.1


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d, bias=False)  # a bias-free layer
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class MLP(nn.Module):
    """Defined only here: shardlab has no ModelSpec for it."""

    def __init__(self, d_in=5, d=12):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.out = nn.Linear(d, 1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_in))  # not a parameter

    def forward(self, x):
        h = self.inp(x * self.scale)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def make_model(seed):
    torch.manual_seed(seed)
    return MLP().double()


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(G, 5, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def reference(steps, edit=None):
    """Plain torch: the whole global batch, mean loss, clip, AdamW (no decay on norms and vectors);
    ``edit(step, model)`` (if given) runs before each step."""
    model = make_model(0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": other, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for s in range(steps):
        if edit is not None:
            edit(s, model)
        x, y = data(s)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(stage, policy, ga):
    return {"parallel": {"zero_stage": stage, "wrap_policy": policy, "microbatches": ga},
            "train": {"precision": "fp64", "lr": LR, "weight_decay": WD, "grad_clip": CLIP,
                      "warmup_steps": 0, "min_lr_ratio": 1.0, "device": "cpu"}}


def train(engine, first, last):
    n, r, ga = engine.world_size, engine.global_rank, engine.accumulation
    per = G // n // ga
    for s in range(first, last):
        x, y = data(s)
        for m in range(ga):
            rows = slice(r * G // n + m * per, r * G // n + (m + 1) * per)
            engine.backward(((engine(x[rows]) - y[rows]) ** 2).mean())
            engine.step()
        assert engine.global_steps == s + 1


LAYOUTS = [("ddp", 0, "blocks", 2), ("zero1", 1, "blocks", 1), ("zero2", 2, "blocks", 2),
           ("zero3-class", 3, "class:Block", 2), ("zero3-size", 3, "size:100", 1),
           ("zero3-blocks", 3, "blocks", 1)]  # a user model's repeated blocks: blocks.0, blocks.1 (units.repeated_blocks)


def _worker(ctx, ckpt_root):
    out = {}
    for name, stage, policy, ga in LAYOUTS:
        directory = Path(ckpt_root) / name
        a = shardlab.initialize(make_model(0), config(stage, policy, ga))
        train(a, 0, SAVE_AT)
        saved = a.save_checkpoint(directory)  # the path on every rank (DeepSpeed: True on every rank)
        assert saved == Path(directory) / f"global_step{SAVE_AT}" / f"step_{SAVE_AT:08d}", (ctx.rank, saved)
        train(a, SAVE_AT, STEPS)
        full = a.full_state_dict()
        b = shardlab.initialize(make_model(7), config(stage, policy, ga))  # other initial values
        assert b.load_checkpoint(directory)[0] is not None and b.global_steps == SAVE_AT
        train(b, SAVE_AT, STEPS)
        resumed = b.full_state_dict(everywhere=True)
        out[name] = (full, resumed) if ctx.rank == 0 else (full, None)
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_layout_matches_plain_torch_and_resumes_exactly(nproc, tmp_path):
    results = launch.run(_worker, nproc, str(tmp_path), timeout_s=60)
    ref = reference(STEPS)
    names = list(make_model(0).state_dict())
    for name, _, _, _ in LAYOUTS:
        full, resumed = results[0][name]
        assert list(full) == names, name  # the model's own state_dict names and order
        for k in names:
            assert (full[k] - ref[k]).abs().max() <= PARITY_ATOL, (name, k)
            assert torch.equal(full[k], resumed[k]), (name, k)  # bit-exact resume
        assert results[1][name][0] == {}  # rank 0 only by default


def test_model_without_parameters_is_refused():
    with pytest.raises(ConfigError) as e:
        shardlab.initialize(nn.ReLU(), {})
    assert e.value.field == "model" and "has no trainable parameters" in str(e.value)


def test_model_parallel_degrees_are_refused():
    with pytest.raises(ConfigError) as e:
        resolve_config({"parallel": {"tp": 2}}, 2)
    assert e.value.field == "parallel.tp"


def test_deepspeed_json_maps_onto_the_world_size():
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
          "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}}}
    cfg = resolve_config(ds, 4)
    assert (cfg.parallel.microbatches, cfg.parallel.dp_shard, cfg.parallel.zero_stage) == (2, 4, 2)
    assert (cfg.train.precision, cfg.train.lr, cfg.train.warmup_steps, cfg.train.steps) == ("bf16", 3e-4, 5, 50)
    with pytest.raises(ConfigError) as e:
        resolve_config(dict(ds, gradient_accumulation_steps=4), 4)  # 16 = 2 * 4 * 2 ranks, not 4
    assert e.value.field == "train_batch_size"


def test_unknown_deepspeed_optimizer_is_a_config_error(tmp_path):
    ds = {"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError) as e:
        resolve_config(ds, 1)
    assert e.value.field == "optimizer.type" and "AdamW" in str(e.value)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    from shardlab.cli import main
    assert main(["train", str(path)]) == 2


def _run_launch(script, nproc=2):
    return subprocess.run([sys.executable, "-m", "shardlab.cli", "launch", "--nproc", str(nproc), str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_launch_starts_ranks_with_the_torchrun_env(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text("import os\ne = os.environ\nline = f\"rank {e['RANK']} of {e['WORLD_SIZE']} {e['LOCAL_RANK']} "
                      "{e['MASTER_ADDR']} {int(e['MASTER_PORT']) > 0}\\n\"\n"
                      "os.write(1, line.encode())  # one write per rank: lines of two ranks never interleave\n")
    r = _run_launch(script)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"rank {k} of 2 {k} 127.0.0.1 True" for k in range(2)]


def test_launch_stops_the_job_when_a_rank_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(5)\ntime.sleep(60)\n")
    r = _run_launch(script)
    assert r.returncode == 5 and "rank 1 failed (exit code 5)" in r.stderr


def _fp16_worker(ctx):
    torch.manual_seed(0)
    model = MLP()  # float32 weights, fp16 autocast
    cfg = {"parallel": {"zero_stage": 2}, "train": {"precision": "fp16", "loss_scale_init": 2.0 ** 40,
                                                    "lr": LR, "device": "cpu", "warmup_steps": 0}}
    engine = shardlab.initialize(model, cfg)
    before = {k: v.clone() for k, v in engine.full_state_dict(everywhere=True).items()}
    history = []
    for s in range(30):
        x, y = data(s)
        rows = slice(ctx.rank * G // 2, (ctx.rank + 1) * G // 2)
        engine.backward(((engine(x[rows].float()) - y[rows].float()) ** 2).mean())
        engine.step()
        history.append((engine.scaler.scale, engine.scaler.skipped))
        if s == 0:
            after_first = engine.full_state_dict(everywhere=True)
    return before, after_first, history, engine.full_state_dict(everywhere=True)


def test_fp16_dynamic_loss_scale_skips_overflowed_steps():
    """fp16 through initialize: a loss scale of 2^40 overflows the fp16 backward; those steps are
    skipped (weights unchanged) and the scale halves until the steps go through."""
    before, after_first, history, final = launch.run(_fp16_worker, 2, timeout_s=60)[0]
    assert all(torch.equal(before[k], after_first[k]) for k in before)  # first step skipped
    scales = [s for s, _ in history]
    assert scales[0] == 2.0 ** 39 and scales[-1] < 2.0 ** 20  # halved on every overflow
    skipped = history[-1][1]
    assert 0 < skipped < 30
    assert any(not torch.equal(before[k], final[k]) for k in before)  # later steps updated weights
    assert all(torch.isfinite(v).all() for v in final.values())


def test_load_checkpoint_says_when_nothing_is_loaded(tmp_path):
    """A mistyped or damaged checkpoint directory used to return None silently, the run starting
    fresh; as DeepSpeed, it now warns (and still returns None: a fresh start is allowed)."""
    torch.manual_seed(0)
    engine = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 3}})
    with pytest.warns(UserWarning, match="nothing loaded, the directory does not exist"):
        assert engine.load_checkpoint(tmp_path / "nope") == (None, None)  # DeepSpeed's pair
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    saved = engine.save_checkpoint(tmp_path / "ckpt")
    weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with torch.no_grad():
        engine.module.weight.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact checkpoint loads without a word
        assert engine.load_checkpoint(tmp_path / "ckpt") == (saved, {})
    assert torch.equal(engine.module.weight, weights["weight"])
    shard = next(Path(saved).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])  # a truncated shard: the only checkpoint is damaged
    with pytest.warns(UserWarning) as record:
        assert engine.load_checkpoint(tmp_path / "ckpt") == (None, None)
    text = " | ".join(str(w.message) for w in record)
    assert "skipping damaged checkpoint" in text and "holds no complete checkpoint" in text, text


def test_client_state_is_saved_and_restored(tmp_path):
    """DeepSpeed's ``save_checkpoint(..., client_state=...)``: your own values come back after a
    load (``engine.client_state``; DeepSpeed returns them beside the path). Values that are not
    JSON are refused before anything is written."""
    torch.manual_seed(0)
    engine = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 3}})
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    mine = {"epoch": 3, "cursor": [1, 2], "name": "run-a", "loss": 0.25}
    with pytest.raises(ConfigError) as e:
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"weights": torch.ones(2)})
    assert e.value.field == "client_state" and not (tmp_path / "ckpt").exists()
    with pytest.raises(ConfigError, match="must be a dict"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state=[3])
    engine.save_checkpoint(tmp_path / "ckpt", client_state=mine)
    fresh = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 3}})
    assert fresh.client_state == {}
    path, client = fresh.load_checkpoint(tmp_path / "ckpt")  # DeepSpeed's (path, client_state)
    assert client == fresh.client_state == mine and fresh.global_steps == 1
    assert path.parent == tmp_path / "ckpt" / "global_step1"  # DeepSpeed's tag of an untagged save


def test_deepspeed_checkpoint_tags(tmp_path, capsys):
    """DeepSpeed's ``save_checkpoint(dir, tag)`` / ``load_checkpoint(dir, tag=None)``: a tag saves
    under ``dir/<tag>`` and is named in ``dir/latest``, which an untagged load follows; a tag passed
    where ``keep`` used to be (second, positional) is a tag, as in DeepSpeed."""
    def run(steps):
        torch.manual_seed(0)
        engine = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 8}})
        for _ in range(steps):
            engine.backward(engine(torch.randn(3, 4)).sum())
            engine.step()
        return engine

    ck = tmp_path / "ck"
    first = run(1)
    first.save_checkpoint(ck, "global_step1", client_state={"epoch": 1})
    assert (ck / "latest").read_text().strip() == "global_step1" and (ck / "global_step1").is_dir()
    second = run(2)
    second.save_checkpoint(ck, 2)  # an integer tag, DeepSpeed's positional place
    assert (ck / "latest").read_text().strip() == "2"
    from shardlab.cli import main as cli_main
    assert cli_main(["checkpoint", "inspect", str(ck)]) == 0  # the CLI follows latest too
    assert capsys.readouterr().out.startswith(f"checkpoint {ck / '2' / 'step_00000002'}")
    fresh = run(0)
    assert fresh.load_checkpoint(ck)[0].parent == ck / "2" and fresh.global_steps == 2
    assert torch.equal(fresh.module.weight, second.module.weight)
    assert fresh.load_checkpoint(ck, tag="global_step1")[0].parent == ck / "global_step1"
    assert fresh.global_steps == 1 and fresh.client_state == {"epoch": 1}
    assert torch.equal(fresh.module.weight, first.module.weight)
    third = run(3)
    third.save_checkpoint(ck)  # untagged: DeepSpeed's tag global_step3, named in latest
    assert (ck / "latest").read_text() == "global_step3\n"
    assert fresh.load_checkpoint(ck)[0] == ck / "global_step3" / "step_00000003" and fresh.global_steps == 3
    third.save_checkpoint(ck, save_latest=False)  # DeepSpeed's save_latest: the same tag, latest left alone
    third.save_checkpoint(ck, keep=1)  # shardlab's keep=: step_NNNNNNNN in dir, pruned, latest removed
    assert not (ck / "latest").exists() and fresh.load_checkpoint(ck)[0] == ck / "step_00000003"
    for bad in ("../x", "", ".hidden", "latest", 1.5):
        with pytest.raises(ConfigError) as e:
            third.save_checkpoint(ck, bad)
        assert e.value.field == "tag", bad
    assert sorted(p.name for p in ck.iterdir()) == ["2", "global_step1", "global_step3", "step_00000003"]
    with pytest.warns(UserWarning, match="nothing loaded, the directory does not exist: .*nosuch"):
        assert fresh.load_checkpoint(ck, tag="nosuch") == (None, None)
    second.cfg.checkpoint.async_save = True  # latest is written once the save commits; a load waits for it
    second.save_checkpoint(ck, "async")
    assert fresh.load_checkpoint(ck)[0].parent == ck / "async" and (ck / "latest").read_text() == "async\n"
    (ck / "latest").write_text("../../etc\n")
    with pytest.raises(ConfigError, match="latest names '../../etc'"):
        fresh.load_checkpoint(ck)


@pytest.mark.parametrize("zero", [0, 2])
def test_load_checkpoint_partial_as_deepspeed(tmp_path, zero):
    """DeepSpeed's ``load_module_only`` (weights and buffers alone: a warm start keeps this engine's
    step count, optimizer, scheduler), ``load_optimizer_states=False`` and
    ``load_lr_scheduler_states=False`` (those two left as they are); DDP and ZeRO-2's flat shards."""
    def run(seed, steps):
        torch.manual_seed(seed)
        engine = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 8}, "parallel": {"zero_stage": zero}},
                                     optimizer=torch.optim.AdamW,
                                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))
        for _ in range(steps):
            engine.backward(engine(torch.randn(3, 4)).sum())
            engine.step()
        return engine

    def moments(engine):
        return [s["exp_avg"].clone() for s in engine.optimizer.state.values()]

    saved = run(0, 3)
    saved.save_checkpoint(tmp_path / "ck")
    for kwargs in ({"load_module_only": True}, {"load_optimizer_states": False},
                   {"load_lr_scheduler_states": False}, {}):
        mine = run(1, 1)
        before_m, before_s = moments(mine), mine.lr_scheduler.state_dict()
        assert mine.load_checkpoint(tmp_path / "ck", **kwargs)[0] is not None
        assert torch.equal(mine.module.weight, saved.module.weight), kwargs  # the weights, always
        only = kwargs.get("load_module_only", False)
        assert mine.global_steps == (1 if only else 3), kwargs
        keep_m = only or not kwargs.get("load_optimizer_states", True)
        got_m = moments(mine)
        want_m = before_m if keep_m else moments(saved)
        assert all(torch.equal(a, b) for a, b in zip(got_m, want_m)), kwargs
        keep_s = only or not kwargs.get("load_lr_scheduler_states", True)
        assert mine.lr_scheduler.state_dict() == (before_s if keep_s else saved.lr_scheduler.state_dict()), kwargs


def test_deepspeed_engine_accessors():
    """gradient_accumulation_steps, train_batch_size, was_step_applied, get_global_grad_norm, as
    DeepSpeed's engine answers them; the norm against the gradients computed by hand."""
    torch.manual_seed(0)
    engine = shardlab.initialize(nn.Linear(4, 2), {"train": {"steps": 3, "global_batch": 6, "grad_clip": 0.0},
                                                  "parallel": {"microbatches": 2}})
    assert (engine.gradient_accumulation_steps(), engine.train_batch_size()) == (2, 6)
    assert engine.get_global_grad_norm() is None
    ref = nn.Linear(4, 2)
    ref.load_state_dict(engine.module.state_dict())
    xs = [torch.randn(3, 4) for _ in range(2)]
    applied = []
    for x in xs:  # DeepSpeed's loop: step() after every backward, an optimizer step at the boundary
        engine.backward(engine(x).pow(2).sum())
        (ref(x).pow(2).sum() / 2).backward()  # the mean over the step's two micro-batches
        engine.step()
        applied.append(engine.was_step_applied())
    want = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    assert applied == [False, True] and abs(engine.get_global_grad_norm() - want) <= 1e-5 * want
    for x in (torch.full((3, 4), float("nan")), xs[0]):
        engine.backward(engine(x).sum())
        engine.step()
    assert not engine.was_step_applied() and engine.skipped_steps == 1  # a non-finite gradient: skipped
