"""analysis/overlap.py: the share of communication time that overlapped compute, read from a
Chrome trace, against hand-computed interval arithmetic."""
import json

from shardlab.analysis.overlap import intersect, merge, overlap, report


def _x(name, ts, dur, cat, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}


def test_merge_and_intersect():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 3), (5, 8)], [(2, 6)]) == 1 + 1
    assert intersect([(0, 1)], [(2, 3)]) == 0


def test_gpu_trace_kernels_on_two_streams():
    """NCCL kernel 100-200 us; compute kernels 0-150 and 180-190: 50 + 10 us of the 100 overlap."""
    tr = {"traceEvents": [_x("ampere_sgemm", 0, 150, "kernel"), _x("ncclDevKernel_AllReduce_Sum_f32", 100, 100, "kernel", 7),
                          _x("vectorized_elementwise", 180, 10, "kernel"), _x("aten::mm", 0, 400, "cpu_op")]}
    o = overlap(tr)
    assert o["device"] == "gpu" and o["comm_us"] == 100 and o["overlapped_us"] == 60
    assert abs(o["fraction"] - 0.6) < 1e-12


def test_cpu_trace_gloo_thread_against_the_loop_thread(tmp_path):
    """gloo:all_reduce on its own thread 50-150; the loop thread computes 0-80 (aten::mm) and
    waits 80-150 (c10d wait, not compute): 30 of 100 us overlap. A second collective 200-220
    with nothing computing: 30 of 120."""
    events = [_x("aten::mm", 0, 80, "cpu_op"), _x("aten::mm", 10, 20, "cpu_op"),  # nested: counted once
              _x("c10d::wait", 80, 70, "cpu_op"), _x("gloo:all_reduce", 50, 100, "user_annotation", tid=9),
              _x("gloo:all_reduce", 200, 20, "user_annotation", tid=9), _x("aten::add", 300, 5, "cpu_op")]
    o = overlap({"traceEvents": events})
    assert o["device"] == "cpu" and o["comm_us"] == 120 and o["overlapped_us"] == 30
    # one profiled step (its ProfilerStep span): 90 us exposed in it; rank1's trace has no step
    (tmp_path / "rank0.json").write_text(json.dumps({"traceEvents": events + [
        _x("ProfilerStep#2", 0, 400, "user_annotation")]}))
    (tmp_path / "rank1.json").write_text(json.dumps({"traceEvents": []}))
    line = report(tmp_path)
    assert "rank0: 0.1 ms communicating, 25% of it overlapped with compute, 0.1 ms exposed per step;" in line
    assert line.endswith("rank1: 0.0 ms communicating, 0% of it overlapped with compute")


def test_cpu_trace_shared_transport_spans_are_communication_never_overlapped():
    """The shared-memory transport runs a collective inline: shm:all_reduce 100-160 on the loop
    thread holds its own copies (aten::copy_ 110-150), which are not compute. gloo 200-300 on its
    thread against compute 0-250 (the loop's mm, minus the shm span): 50 of it overlaps. Total
    comm 60 + 100 us, overlapped 50."""
    events = [_x("aten::mm", 0, 250, "cpu_op"), _x("aten::mm", 20, 30, "cpu_op"),
              _x("shm:all_reduce", 100, 60, "user_annotation"), _x("aten::copy_", 110, 40, "cpu_op"),
              _x("gloo:all_reduce", 200, 100, "user_annotation", tid=9)]
    o = overlap({"traceEvents": events})
    assert o["device"] == "cpu" and o["comm_us"] == 160 and o["overlapped_us"] == 50


def test_subtract():
    from shardlab.analysis.overlap import subtract
    assert subtract([(0, 10), (12, 20)], [(2, 3), (5, 13), (19, 25)]) == [(0, 2), (3, 5), (13, 19)]
    assert subtract([(0, 10)], []) == [(0, 10)] and subtract([(0, 10)], [(-5, 10)]) == []


def test_gpu_trace_host_side_collectives():
    """CUDA tensors over gloo or the shared transport: no collective kernel. gloo:all_reduce on
    its thread 100-200 while a GEMM runs 0-150: 50 of 100 us overlap. shm:all_gather 300-340 on
    the loop thread launches its own copy kernel 310-330 (not compute): 0 of 40. Total 50 of 140."""
    events = [_x("sm90_xmma_gemm", 0, 150, "kernel", tid=7), _x("gloo:all_reduce", 100, 100, "user_annotation", tid=9),
              _x("aten::mm", 0, 20, "cpu_op"), _x("shm:all_gather", 300, 40, "user_annotation"),
              _x("Memcpy DtoD", 310, 20, "kernel", tid=7)]
    o = overlap({"traceEvents": events})
    assert o["device"] == "gpu" and o["comm_us"] == 140 and o["overlapped_us"] == 50


def test_gpu_trace_shared_transport_on_its_stream():
    """The shared transport on CUDA (shm_cuda.py): shm:all_reduce 0-10 on the loop thread queues a
    copy (correlation 5) and a reduction (6) that run 50-70 and 70-90 on the comm stream; a GEMM
    launched outside it (7) runs 40-80 on the compute stream. Communication is the GPU work the
    span launched (50-90: 40 us), not the host span nor its projection on the GPU row (a
    ``gpu_user_annotation``, which on the H100 run hid every overlap: 0%); the GEMM covers 50-80
    of it: 30 of 40."""
    def launch(ts, corr, tid=1):
        return {**_x("cudaLaunchKernel", ts, 1, "cuda_runtime", tid=tid), "args": {"correlation": corr}}

    def gpu(name, ts, dur, corr, cat="kernel"):
        return {**_x(name, ts, dur, cat, tid=20), "args": {"correlation": corr}}
    events = [_x("shm:all_reduce", 0, 10, "user_annotation", tid=1), launch(2, 5), launch(6, 6), launch(20, 7),
              _x("shm:all_reduce", 45, 50, "gpu_user_annotation", tid=20),  # the profiler's GPU copy of the range
              gpu("Memcpy DtoD", 50, 20, 5, "gpu_memcpy"), gpu("elementwise_add", 70, 20, 6),
              gpu("sm90_xmma_gemm", 40, 40, 7)]
    o = overlap({"traceEvents": events})
    assert o["device"] == "gpu" and o["comm_us"] == 40 and o["overlapped_us"] == 30


def test_gpu_trace_comm_thread_the_profiler_did_not_record():
    """The H100 trace of 2026-11-27 with ``parallel.comm_thread``: torch's profiler recorded no
    operator of the comm thread (started before it), only that thread's CUDA launches (tid 99:
    correlations 5 and 6, a copy 50-70 and an add 70-90 on the comm stream). The loop thread
    (tid 1, operators) launches a GEMM (7) running 40-80. Communication is the comm thread's GPU
    work, 40 us, of which the GEMM covers 30; exposed 10. Before the fix it read 0 us."""
    def call(ts, corr, tid):
        return {**_x("cudaLaunchKernel", ts, 1, "cuda_runtime", tid=tid), "args": {"correlation": corr}}

    def gpu(name, ts, dur, corr, cat="kernel"):
        return {**_x(name, ts, dur, cat, tid=20), "args": {"correlation": corr}}
    events = [_x("aten::mm", 19, 3, "cpu_op", tid=1), call(20, 7, 1), call(2, 5, 99), call(6, 6, 99),
              gpu("Memcpy DtoD", 50, 20, 5, "gpu_memcpy"), gpu("elementwise_add", 70, 20, 6), gpu("sm90_xmma_gemm", 40, 40, 7)]
    o = overlap({"traceEvents": events})
    assert (o["device"], o["comm_us"], o["overlapped_us"], o["exposed_us"]) == ("gpu", 40, 30, 10)
