"""analysis/memtrace.py: the profiler's categories at the allocation peak of a step count the
parameters and AdamW's states of a known model exactly; the recorder samples and marks; the
timeline picture is written."""
import pytest
import torch

from shardlab.analysis.memtrace import Recorder, Trace, categories_at_peak, draw, profiled


def test_categories_count_parameters_and_optimizer_states():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(32, 256)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW creates m and v here
    with profiled(True) as prof:
        step()
    got = categories_at_peak(prof, torch.device("cpu"))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert got["parameters"] == param_bytes
    steps = 4 * len(list(model.parameters()))  # AdamW's step counter: one fp32 scalar per parameter
    assert got["optimizer states"] == 2 * param_bytes + steps  # m and v
    assert got["allocated"] >= got["parameters"] + got["optimizer states"] + got["gradients"]


def test_recorder_marks_and_draws(tmp_path):
    with Recorder(torch.device("cpu"), rank=0, interval_s=0.001) as rec:
        rec.mark("forward 0")
        big = torch.ones(4 << 20)  # 16 MiB
        rec.mark("backward 0")
        del big
        rec.mark("optimizer 0")
    tr = rec.trace
    assert [m[1] for m in tr.marks] == ["forward 0", "backward 0", "optimizer 0", "end"]
    assert tr.peak >= max(s[1] for s in tr.samples) > 0 and tr.baseline > 0
    draw([tr, Trace(rank=1, samples=[(0.0, 1 << 20)], peak=1 << 20)], str(tmp_path / "t.png"), "test", [2 << 20, 2 << 20])
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_memory_command_refuses_bad_arguments_before_launch(capsys):
    """A timeline path in a missing folder, a timeline without a run, or no measured step: one
    line naming the flag, exit code 2, no rank started."""
    from shardlab.cli import main
    for argv, flag in ((["--timeline", "/nonexistent/x.png"], "--timeline"),
                       (["--timeline", "t.png", "--no-run"], "--timeline"), (["--steps", "0"], "--steps")):
        assert main(["memory", "configs/tiny.toml", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"config error: {flag}") and "\n" not in err, err


def test_memory_command_states_reserved_beside_the_cuda_measurement(monkeypatch, capsys):
    """On CUDA the peak line names the measured reserved bytes and the stated estimate beside them
    (predict.RESERVED_PER_ALLOCATED x the predicted peak); the run itself is replaced by traces of
    the shape a CUDA run returns, since this machine has no GPU."""
    from shardlab.analysis.measured_memory import StateBytes
    from shardlab.analysis.memtrace import Trace
    from shardlab.analysis.predict import RESERVED_PER_ALLOCATED
    from shardlab.cli import main
    from shardlab.commands import memory_cmd
    mib = 2**20
    fake = [(StateBytes(1.0, 1.0, 1.0), Trace(rank=r, device="cuda", peak=300 * mib, reserved=340 * mib))
            for r in range(2)]
    monkeypatch.setattr(memory_cmd, "measure_run", lambda *a, **k: fake)
    assert main(["memory", "configs/tiny.toml", "--nproc", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("rank 0: predicted")]
    assert len(lines) == 1 and "reserved 340.0 (stated " in lines[0], lines
    predicted = float(lines[0].split("predicted ")[1].split()[0].replace(",", ""))
    stated = float(lines[0].split("(stated ")[1].split(":")[0].replace(",", ""))
    assert stated == pytest.approx(predicted * RESERVED_PER_ALLOCATED, abs=0.06)


def test_the_empty_rank_is_split_into_heap_libraries_and_shared_memory():
    """The baseline's parts (what `shardlab memory` subtracts from the end's to say where a run's
    growth went) add up to the baseline: the kernel's VmRSS is RssAnon + RssFile + RssShmem."""
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/status")
    from shardlab.analysis.memtrace import SPLIT, Recorder
    rec = Recorder("cpu")
    parts = rec.trace.baseline_split
    assert set(parts) == set(SPLIT) and parts["RssAnon"] > 0 and parts["RssFile"] > 0
    assert sum(parts.values()) == rec.trace.baseline  # one read of /proc/self/status: the kernel sums them
