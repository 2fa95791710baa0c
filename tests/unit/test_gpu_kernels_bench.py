"""benchmarks/gpu_kernels.py (the kernel rates behind the planner's constants) on the CPU at tiny
sizes: its FLOP counts are the products' 2MKN x 3 and, for attention, the planner's own
convention (plan_time: the spec's 3 x forward, causal half, times FLASH_BWD_EXTRA), so a rate it
prints on a GPU is directly comparable with ``mm_eff`` / ``attn_eff``."""
import json
import sys
from pathlib import Path

import pytest

from shardlab.analysis.plan_time import FLASH_BWD_EXTRA

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_kernels  # noqa: E402


def test_the_kernel_benchmark_counts_flops_as_the_planner_prices_them(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert gpu_kernels.main(["--device", "cpu", "--quick", "--reps", "2", "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    mm = [r for r in rows if r["kind"] == "matmul"]
    assert [r["flops"] for r in mm] == [3 * 2 * 64 * 32 * 48, 3 * 2 * 64 * 48 * 32]
    fp8 = [r for r in rows if r["kind"] == "matmul-fp8"]  # torch._scaled_mm runs on this CPU build too
    assert [(r["shape"], r.get("flops"), "error" in r) for r in fp8] == \
        [("64x32->48", 3 * 2 * 64 * 32 * 48, False), ("64x48->32", 3 * 2 * 64 * 48 * 32, False)]
    assert all(r["seconds"] > 0 for r in fp8)
    att = [r for r in rows if r["kind"] == "attention"]
    assert [r["shape"] for r in att] == ["b4 h2 s32 d16", "b2 h2 s64 d16"]
    for r, (b, s) in zip(att, ((4, 32), (2, 64))):
        spec = 3 * 4 * s * s * 16 * 2 * b  # the spec's attention FLOPs: forward + backward, non-causal
        assert r["flops"] == pytest.approx(0.5 * spec * FLASH_BWD_EXTRA)
        assert r["fwd_flops"] + r["bwd_flops"] == pytest.approx(r["flops"])
        assert r["seconds"] > 0 and r["fwd_s"] > 0
    ew = [r for r in rows if r["kind"] == "elementwise"]
    assert ew[0]["bytes"] == 3 * 4096 * 4  # two fp32 reads, one write
    printed = capsys.readouterr().out
    assert "| attention | b4 h2 s32 d16 | default |" in printed and "| matmul-fp8 | 64x32->48 | _scaled_mm |" in printed


def test_the_kernel_benchmark_refuses_cuda_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_kernels.main(["--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("--device:")
