"""train.detect_anomaly = first_module (docs/faults.md "Finding the first non-finite value"): the
first module that produced an inf/nan is named, forward or backward, with the rank and the step."""
import pytest
import torch

from shardlab import config as C
from shardlab import launch
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0",
        "--checkpoint.save=false", "--train.steps=4", "--train.detect_anomaly=first_module"]


class _NanGrad(torch.autograd.Function):
    """Identity forward; nan gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def _poisoned_worker(ctx, data_dir, target, how, rank, step):
    """train_rank with module ``target`` poisoned at training step ``step`` on rank ``rank``:
    ``how`` = forward (its output is inf) or backward (its input gradient is nan)."""
    from shardlab.train import loop
    init = loop.Trainer.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        module = self.engine.model.get_submodule(target)
        forward, tr = module.forward, self

        def poisoned(*args, **kw):
            out = forward(*args, **kw)
            if module.training and ctx.rank == rank and tr.step + 1 == step:
                out = out * float("inf") if how == "forward" else _NanGrad.apply(out)
            return out
        module.forward = poisoned
    loop.Trainer.__init__ = patched
    return loop.train_rank(ctx, data_dir)


def _run(tmp_path, how, *extra):
    from shardlab.train.data import prepare
    from shardlab.train.plan import make_plan
    cfg = C.load(None, TINY + [f"--data.cache_dir={tmp_path}/cache", f"--logging.run_dir={tmp_path}/run",
                               "--parallel.dp_replicate=2", *extra]).validate(2)
    return launch.run(_poisoned_worker, 2, str(prepare(cfg.data)), "layers.1.feed_forward", how, 1, 2,
                      plan=make_plan(cfg))[0]


def test_forward_inf_is_named(tmp_path):
    s = _run(tmp_path, "forward")
    msg = s["stopped"]
    assert s["steps"] == 2 and "\n" not in msg, msg
    assert ("stopped at step 2: non-finite value (inf) first produced by module 'layers.1.feed_forward' in forward "
            "(its output) on rank 1 at step 2") in msg, msg
    print(msg)


def test_backward_nan_is_named(tmp_path):
    s = _run(tmp_path, "backward")
    msg = s["stopped"]
    assert s["steps"] == 2 and "\n" not in msg, msg
    # the nan gradient appears at the input of the poisoned feed_forward's output function: the feed_forward is the first
    # module whose input gradient is non-finite (modules after it in the forward pass are clean)
    assert "(nan) first produced by module 'layers.1.feed_forward' in backward" in msg and "on rank 1 at step 2" in msg, msg
    print(msg)


def test_skip_logs_the_module_and_goes_on(tmp_path):
    from shardlab.train.metrics import read_metrics
    s = _run(tmp_path, "forward", "--train.nonfinite=skip", "--logging.log_every=1")
    assert s["stopped"] is None and s["steps"] == 4
    recs = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "anomaly"]
    assert len(recs) == 1 and recs[0]["step"] == 2 and "'layers.1.feed_forward' in forward" in recs[0]["message"]


def test_detect_anomaly_choices_are_checked():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["--train.detect_anomaly=all"]).validate(1)
    assert e.value.field == "train.detect_anomaly"
