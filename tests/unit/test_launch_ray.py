"""--launcher ray's bad-input paths (docs/ray.md): without Ray installed one line saying how to install
the extra (exit 2); an unreachable --ray-address fails within seconds naming the address (exit 2);
Ray flags without --launcher ray are refused. No Ray instance is started here."""
import socket
import sys

from shardlab.cli import main as cli_main

ARGS = ["train", "--nproc", "2", "--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4",
        "--model.n_kv_heads=2", "--model.max_seq_len=16", "--train.seq_len=16", "--train.global_batch=4"]


def _one_line(capsys):
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_without_ray_one_line_how_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray"]) == 2
    assert "pip install 'shardlab[ray]'" in _one_line(capsys)
    script = tmp_path / "s.py"
    script.write_text("")
    assert cli_main(["launch", "--nproc", "2", "--launcher", "ray", str(script)]) == 2
    assert "pip install 'shardlab[ray]'" in _one_line(capsys)
    assert not (tmp_path / "ray").exists()


def test_unreachable_address_names_it(capsys, tmp_path):
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray",
                         "--ray-address", f"127.0.0.1:{port}"]) == 2
    err = _one_line(capsys)
    assert "--ray-address" in err and f"127.0.0.1:{port}" in err, err
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray", "--ray-address", "nonsense"]) == 2
    assert "HOST:PORT" in _one_line(capsys)


def test_ray_flags_need_the_ray_launcher(capsys, tmp_path):
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--ray-strategy", "SPREAD"]) == 2
    assert "--ray-strategy" in _one_line(capsys)
    assert cli_main([*ARGS, f"--logging.run_dir={tmp_path}", "--launcher", "ray", "--checkpoint.async_save=true"]) == 2
    assert "checkpoint.async_save" in _one_line(capsys)


def test_a_driver_error_is_the_launchers_not_rank_0s():
    """An exception from Ray's driver with no worker failure in it (a signal inside ``fit``, Ray's
    storage) used to read "rank 0 failed"; a worker's failure still names its rank."""
    from types import SimpleNamespace

    from shardlab.launch_ray import _as_worker_error
    err = _as_worker_error(SystemError("alarm in the driver"))
    assert err.rank is None and str(err).startswith("the launcher failed (no rank did):\nSystemError: alarm")
    failed = SimpleNamespace(worker_failures={3: ValueError("bad"), 1: RuntimeError("boom")})
    err = _as_worker_error(failed)
    assert err.rank == 1 and str(err) == "rank 1 failed:\nRuntimeError: boom"
