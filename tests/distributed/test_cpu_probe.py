"""The planner's CPU probe (analysis/devices.probe_cpu) measured afresh, as ``shardlab plan --gpu
cpu`` runs it on a machine with no cached probe: between 2026-11-26 (35474f8, when the MFU peak
probe became cached and started returning a label) and 2026-11-27 it failed with a TypeError
before measuring anything. Two ranks, one group size and two repetitions keep it short."""
from shardlab.analysis.devices import get_device, probe_cpu


def test_a_fresh_probe_measures_this_cpu(tmp_path):
    pr = probe_cpu(cache_dir=str(tmp_path), refresh=True, comm_sizes=(2,), reps=2)
    assert pr["flops"] > 1e8 and 0 < pr["mm_eff"] <= 1.0  # one thread's matmul rate, measured here
    assert pr["mem_bw"] > 0 and pr["op_s"] > 0 and pr["comm_curve"]
    assert (tmp_path / "cpu_probe.json").exists()
    dev = get_device("cpu", pr)
    assert dev.peak_flops == pr["flops"]
