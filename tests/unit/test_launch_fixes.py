"""Launcher fixes that need no Ray instance and no torchrun (docs/ray.md, docs/faults.md): Ray's
start and connection failures are one line (exit 2), a local Ray is always our own
(``address="local"``) and its CPUs are checked against the workers before it starts, Ray's SIGTERM
handler does not replace shardlab's, the flight-recorder dump directory is removed when empty, a
torchrun restart resumes, and ``python -m shardlab`` runs the command line. ``ray.init`` is
replaced by a fake here: nothing starts."""
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from shardlab import launch, launch_ray, launch_restart
from shardlab.cli import main as cli_main
from shardlab.launch_report import close_dump_dir
from tests.unit.test_launch_ray import ARGS, _one_line


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init recorded (and raising ``fake_ray.error`` when set); nothing starts."""
    ray = pytest.importorskip("ray")
    calls = []

    class Fake:
        error = None
        handler = None  # installed as SIGTERM's, as Ray's driver does

    def init(**kw):
        calls.append(kw)
        if Fake.handler:
            signal.signal(signal.SIGTERM, Fake.handler)
        if Fake.error:
            raise Fake.error
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    Fake.calls = calls
    return Fake


def test_local_ray_is_our_own_even_with_a_cluster_or_ray_address(fake_ray, monkeypatch):
    """Item 1: ray.init(num_cpus=...) joined RAY_ADDRESS / a running cluster, and Ray refused the CPUs."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert launch_ray.ensure_ray(launch_ray.RayOptions(), 2)
    assert fake_ray.calls[-1]["address"] == "local" and fake_ray.calls[-1]["num_cpus"] >= 2


@pytest.mark.parametrize("address,flag", [(None, "--launcher"), ("auto", "--ray-address")])
def test_ray_init_failure_is_one_line(fake_ray, capsys, tmp_path, address, flag):
    """Item 2: `--ray-address auto` with no cluster, a cluster refusing us, a local start failing."""
    fake_ray.error = ConnectionError("Could not find any running Ray instance.\nPlease specify the address")
    extra = ["--ray-address", address] if address else []
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err  # after "shardlab: training ...": one line
    assert err.splitlines()[-1].startswith(f"config error: {flag}: could not "), err
    assert "Could not find any running Ray instance" in err.splitlines()[-1]


def test_too_few_cpus_refused_before_ray_starts(fake_ray, capsys, tmp_path):
    """Item 3: --ray-num-cpus 1 with --nproc 2 waited forever for the second worker."""
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray", "--ray-num-cpus", "1"]) == 2
    err = _one_line(capsys)
    assert "--ray-num-cpus" in err and "--ray-num-cpus 2" in err, err
    script = tmp_path / "s.py"
    script.write_text("")
    assert cli_main(["launch", "--nproc", "2", "--launcher", "ray", "--ray-num-cpus", "3",
                     "--ray-cpus-per-worker", "2", str(script)]) == 2
    assert "--ray-num-cpus 4" in _one_line(capsys)
    assert fake_ray.calls == []


def test_ray_num_cpus_with_an_address_is_refused(fake_ray, capsys, tmp_path):
    """Item 9: --ray-num-cpus with --ray-address was silently ignored."""
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray", "--ray-address", "auto",
                     "--ray-num-cpus", "4"]) == 2
    assert "--ray-num-cpus" in _one_line(capsys) and fake_ray.calls == []


def test_worker_start_timeout_is_one_line():
    """Item 3: a worker group that cannot be placed on a joined cluster ends in one line."""
    from types import SimpleNamespace

    class WorkerGroupStartupTimeoutError(Exception):
        pass
    err = SimpleNamespace(controller_failure=WorkerGroupStartupTimeoutError("timed out"))
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
        with pytest.raises(launch_ray.ConfigError, match="could not start 4 workers .* has 2 CPUs"):
            launch_ray._refuse_if_not_started(err, 4, launch_ray.RayOptions())
    launch_ray._refuse_if_not_started(SimpleNamespace(), 4, launch_ray.RayOptions())  # others: not refused


def test_ray_does_not_replace_shardlabs_sigterm_handler(fake_ray):
    """Item 4: Ray's driver installs its own SIGTERM handler (a dump, exit 1); cli.py's is put back."""
    from shardlab.cli import Terminated, _on_sigterm
    fake_ray.handler = lambda *a: None
    before = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for error in (None, RuntimeError("boom")):
            fake_ray.error = error
            try:
                launch_ray.ensure_ray(launch_ray.RayOptions(), 1)
            except launch_ray.ConfigError:
                assert error is not None
            handler = signal.getsignal(signal.SIGTERM)
            assert handler is not fake_ray.handler
            with pytest.raises(Terminated):  # cli.py's handler, chained: what it raised is kept for run()
                handler(signal.SIGTERM, None)
            assert isinstance(launch_ray._RAISED.pop(), Terminated)
            signal.signal(signal.SIGTERM, _on_sigterm)
    finally:
        signal.signal(signal.SIGTERM, before)


def _raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    return 0


def test_failed_run_leaves_no_empty_flight_dir(tmp_path, monkeypatch):
    """Item 7: the dump directory was removed only after a success."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(launch.WorkerError):
        launch.run(_raise_on_rank1, 2, timeout_s=20)
    assert not list(tmp_path.glob("shardlab-flight-*"))


def test_close_dump_dir_keeps_and_names_dumps(tmp_path):
    said = []
    empty, held, bad = (tempfile.mkdtemp(prefix="shardlab-flight-", dir=tmp_path) for _ in range(3))
    for d in (held, bad):
        open(os.path.join(d, "rank0.json"), "w").close()
    close_dump_dir(empty, False, None, said.append)
    close_dump_dir(held, False, None, said.append)  # interrupted: no report named it
    close_dump_dir(bad, False, launch.WorkerError(0, "ConfigError: bad"), said.append)
    assert not os.path.exists(empty) and os.path.exists(held) and not os.path.exists(bad)
    assert said == [f"shardlab: flight-recorder dumps of the ranks kept in {held}"]
    close_dump_dir(held, False, launch.WorkerError(0, f"x\n  full dumps: {held}"), said.append)
    assert len(said) == 1  # the report named it already


def test_torchrun_restart_resumes(monkeypatch):
    """Item 6: a torchrun restart (TORCHELASTIC_RESTART_COUNT >= 1) resumes; --resume on a first start
    of a job with a restart policy starts fresh where no checkpoint directory exists yet."""
    from shardlab import config as C
    cfg = C.Config()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert launch_restart.torchrun_restart(cfg) == 0 and not cfg.checkpoint.resume
    assert not launch_restart.may_start_fresh()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert launch_restart.may_start_fresh()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch_restart.torchrun_restart(cfg) == 1 and cfg.checkpoint.resume
    monkeypatch.delenv("RANK")  # not under torchrun: these variables mean nothing
    assert launch.elastic_restarts() == (0, 0)


def test_python_dash_m_shardlab():
    """Item 6: `python -m shardlab` (so `torchrun ... -m shardlab train`) runs the command line."""
    out = subprocess.run([sys.executable, "-m", "shardlab", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout, out.stderr
