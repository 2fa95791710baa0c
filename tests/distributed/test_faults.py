"""Faults (docs/faults.md): ranks never outlive a killed launcher, --resume never destroys or
silently starts over, interrupted saves are cleaned up, a finished run says so, a non-finite
loss stops the run in one line (or is skipped), ``| head`` and the end of a run print no noise."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlab import config as C
from shardlab import launch
from shardlab.cli import main as cli_main
import shardlab.train.checks  # noqa: F401  (registers every config check: ranks validate too)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4", "--train.warmup_steps=0",
        "--logging.progress=false", "--logging.tensorboard=false", "--train.eval_batches=1", "--train.eval_every=0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _shardlab(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "shardlab.cli", *args], cwd=ROOT, env=env, **kw)


def _descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            for k in kids:
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (nobody reaped it yet)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def _training(tmp_path, cache):
    """A 2-rank run of many steps, once it trains and saves every step: (launcher, its descendants)."""
    run = tmp_path / "run"
    proc = _shardlab(["train", "configs/tiny.toml", "--nproc", "2", *TINY, "--train.steps=100000",
                      "--checkpoint.every=1", "--logging.log_every=1", f"--logging.run_dir={run}",
                      f"--data.cache_dir={cache}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                     start_new_session=True)
    try:
        deadline = time.time() + 60
        while not list((run / "checkpoints").glob("step_*")):  # training and saving every step
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 2, ranks
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, ranks


def test_ranks_die_with_a_killed_launcher(tmp_path, cache):
    proc, ranks = _training(tmp_path, cache)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 20  # a liveness bound, not a speed target: on a loaded 2-core host the forkserver's
    while any(_alive(p) for p in ranks) and time.time() < deadline:  # exit and the ranks' took > 5 s once (2026-12-07)
        time.sleep(0.05)
    assert not [p for p in ranks if _alive(p)], "rank processes outlived the killed launcher"


def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path, cache):
    """SIGTERM to the launcher alone (a scheduler's preemption) used to end it with status -15 and
    no word while its ranks trained on until they noticed its death; now it stops them through the
    Ctrl-C path: one line, status 143, no rank left, every checkpoint written complete."""
    proc, ranks = _training(tmp_path, cache)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read().decode().strip().splitlines()
    assert code == 143 and err[-1] == "shardlab: terminated (SIGTERM); the ranks were stopped", err[-5:]
    deadline = time.time() + 20  # the forkserver and resource tracker follow their parent (a liveness bound)
    while any(_alive(p) for p in ranks) and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if _alive(p)], "processes outlived the launcher"
    assert not any("Traceback" in line for line in err), err


def _die_worker(ctx):
    return launch.die_with_parent(os.getppid())


def test_die_with_parent_uses_pdeathsig_on_linux():
    mech, = launch.run(_die_worker, 1)
    assert mech == ("pdeathsig" if sys.platform.startswith("linux") else "watchdog")


def _train(tmp, *extra):
    return cli_main(["train", "--nproc", "1", *TINY, f"--data.cache_dir={tmp}/cache",
                     f"--logging.run_dir={tmp}/run", *extra])


def test_resume_of_a_missing_directory_refuses(tmp_path, capsys):
    assert _train(tmp_path, "--train.steps=2", "--resume") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "run" / "checkpoints") in err[0] and "drop --resume" in err[0], err
    assert not (tmp_path / "run").exists()


def test_interrupted_save_is_removed_and_finished_run_says_so(tmp_path, capsys):
    assert _train(tmp_path, "--train.steps=2", "--checkpoint.every=1") == 0
    ck = tmp_path / "run" / "checkpoints"
    (ck / ".tmp-step_00000003").mkdir()  # what a launcher killed during a save leaves
    (ck / ".tmp-step_00000003" / "rank_00000.safetensors").write_bytes(b"x" * 10)
    capsys.readouterr()
    assert _train(tmp_path, "--train.steps=2", "--resume") == 0
    cap = capsys.readouterr()
    removed = [x for x in cap.err.splitlines() if "unfinished checkpoint save" in x]
    assert len(removed) == 1 and ".tmp-step_00000003" in removed[0], cap.err
    assert not (ck / ".tmp-step_00000003").exists()
    out = cap.out.strip().splitlines()
    assert len(out) == 1 and "already finished" in out[0] and "step 2" in out[0], out
    assert "nan" not in cap.out


def test_old_copy_of_a_resaved_step_is_restored(tmp_path):
    from shardlab.checkpoint.save import remove_interrupted
    ck = tmp_path / "ck"
    (ck / ".old-step_00000004").mkdir(parents=True)  # crash between the two renames of commit()
    (ck / ".old-step_00000002").mkdir()
    (ck / "step_00000002").mkdir()
    assert remove_interrupted(ck) == [ck / ".old-step_00000002"]
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000004"]


def test_nonfinite_loss_stops_in_one_line(tmp_path, capsys):
    # a nan in a weight makes step 1's loss nan on every host (a divergent lr overflowed at a step
    # that varied between machines, and on some not within the run): export a trained step as a
    # Hugging Face directory, put a nan into the final norm's weight, import it and train on from it
    from safetensors.torch import load_file, save_file
    assert _train(tmp_path, "--train.steps=1", "--checkpoint.every=1") == 0
    assert cli_main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--format", "hf",
                     "--to", str(tmp_path / "hf")]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert cli_main(["checkpoint", "import", str(tmp_path / "hf"), "--to", str(tmp_path / "nan" / "checkpoints")]) == 0
    capsys.readouterr()
    code = _train(tmp_path, f"--logging.run_dir={tmp_path}/nan", "--resume", "--train.steps=3", "--checkpoint.save=false")
    cap = capsys.readouterr()
    err = [x for x in cap.err.strip().splitlines() if not x.startswith("shardlab: training ")]
    assert code == 1 and len(err) == 1 and "stopped at step 1:" in err[0] and "not finite" in err[0], cap.err
    assert "Traceback" not in cap.err and "nan" not in cap.out


def _skip_worker(ctx, cfg, data_dir, fused=False):
    from shardlab.distributed.mesh import Mesh
    from shardlab.distributed.topology import Topology
    from shardlab.train import loop, optim
    from shardlab.train.data import TokenData
    from shardlab.train.loop import Trainer, resolve
    if fused:  # the CUDA path on the CPU: torch's fused AdamW skips the step itself (found_inf)
        t = cfg.train
        loop.build_adamw = lambda *_: lambda groups: torch.optim.AdamW(
            groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay, fused=True)
    tr = Trainer(cfg, Mesh.build(Topology.from_config(cfg.parallel), ctx.device), TokenData(data_dir))
    assert optim.skips_on_device(tr.optimizer) == fused
    fb = tr.engine.forward_backward

    def poisoned(*a, **k):  # step 1's gradients are nan
        out = fb(*a, **k)
        if tr.step == 1:
            for g in tr.engine.grads():
                g.fill_(float("nan"))
        return out
    tr.engine.forward_backward = poisoned
    outs, params = [], []
    for _ in range(3):
        outs.append(resolve(tr.train_step()))
        params.append([p.detach().clone() for p in tr.engine.parameters()])
    return [(o["skipped"], o["nonfinite"]) for o in outs], params


@pytest.mark.parametrize("fused", [False, True])
def test_nonfinite_skip_leaves_the_parameters(tmp_path, fused):
    from shardlab.train.data import prepare
    cfg = C.load(None, TINY + [f"--data.cache_dir={tmp_path}/cache", f"--logging.run_dir={tmp_path}/run",
                               "--train.nonfinite=skip"])
    (flags, params), = launch.run(_skip_worker, 1, cfg, str(prepare(cfg.data)), fused)
    assert flags == [(False, False), (True, True), (False, False)]
    assert all(torch.equal(a, b) for a, b in zip(params[0], params[1]))  # the skipped step changed nothing
    assert all(bool(torch.isfinite(p).all()) for p in params[2])
    assert not all(torch.equal(a, b) for a, b in zip(params[1], params[2]))


def test_nonfinite_choices_are_checked():
    with pytest.raises(C.ConfigError) as e:
        C.load(None, ["--train.nonfinite=ignore"]).validate(1)
    assert e.value.field == "train.nonfinite" and "stop" in str(e.value)


def test_no_leak_warning_and_no_traceback_into_head(tmp_path, cache):
    proc = _shardlab(["train", "--nproc", "2", *TINY, "--train.steps=2", "--logging.progress=true",
                      f"--logging.run_dir={tmp_path}/run", f"--data.cache_dir={cache}"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"leaked" not in err and b"Traceback" not in err, err.decode()[-2000:]
    # `shardlab config show | head -1`: the reader has closed the pipe before the output is written
    r, w = os.pipe()
    os.close(r)
    try:
        closed = _shardlab(["config", "show", "configs/tiny.toml"], stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    _, err = closed.communicate(timeout=60)
    assert closed.returncode == 141 and err == b"", err.decode()
    r, w = os.pipe()  # a command that turns OSError into a one-line error (checkpoint inspect)
    os.close(r)
    ck = next((tmp_path / "run" / "checkpoints").glob("step_*"))
    try:
        closed = _shardlab(["checkpoint", "inspect", str(ck)], stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    _, err = closed.communicate(timeout=60)
    assert closed.returncode == 141 and err == b"", err.decode()
