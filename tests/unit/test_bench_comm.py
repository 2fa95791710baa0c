"""`shardlab bench comm`: size parsing, the nccl-tests table, and errors before any rank starts."""
import pytest

from shardlab import cli
from shardlab.commands import bench_comm as bc


def test_parse_sizes():
    assert bc.parse_sizes("1K..8K") == [1024, 2048, 4096, 8192]
    assert bc.parse_sizes("4,1K,4M") == [4, 1024, 4 << 20]
    assert bc.parse_sizes("1..64", factor=4) == [1, 4, 16, 64]
    assert bc.parse_size("2MiB") == 2 << 20
    with pytest.raises(ValueError, match="--sizes"):
        bc.parse_size("4X")
    with pytest.raises(ValueError, match="is 0 bytes"):  # ran a 1-element tensor labelled 0B
        bc.parse_sizes("0,4K")
    assert [bc.human(s) for s in (4, 1024, 3 << 20, 1536)] == ["4B", "1K", "3M", "1.5K"]


def test_columns_skip_algorithms_that_run_the_same_code():
    assert bc.columns("all_reduce", ["backend", "ring", "tree", "rhd"], [1024]) == ["backend", "ring", "tree", "rhd"]
    assert bc.columns("all_gather", ["backend", "ring", "tree", "rhd"], [1024]) == ["backend", "ring"]
    assert bc.columns("broadcast", ["ring", "tree", "rhd"], [1024]) == ["ring", "tree"]
    assert bc.label("broadcast", "tree") == "binomial" and bc.label("all_to_all", "ring") == "pairwise"


def test_table_bus_bandwidth():
    rows = [dict(op="all_reduce", size=4 << 20, count=1 << 20, algorithm=a, seconds=s, iters=3, sent_per_rank=0)
            for a, s in (("backend", 0.004), ("ring", 0.005))]
    text = bc.table(rows, 4)
    line = [l for l in text.splitlines() if l.strip().startswith("4M")][0].replace("|", " ").split()
    # algbw = 4 MiB / 4 ms = 1.049 GB/s; busbw = algbw * 2*3/4; ring is 0.8x the backend
    assert line[2:5] == ["4000.0", "1.049", "1.573"] and line[-1] == "0.80"


def test_table_with_tiers_shows_slow_tier_bytes():
    rows = [dict(op="all_to_all", size=1 << 20, count=1 << 18, algorithm="backend", seconds=0.002, iters=3,
                 sent_per_rank=3 << 18, inter_per_rank=1 << 19)]
    text = bc.table(rows, 4, nodes=2)
    assert "2 simulated nodes of 2" in text and "inter KiB" in text
    assert text.splitlines()[3].replace("|", " ").split()[-1] == "512.0"
    assert "inter KiB" not in bc.table(rows, 4)


@pytest.mark.parametrize("argv, msg", [
    (["bench", "comm", "--ops", "allreduce"], "--ops"),
    (["bench", "comm", "--algorithms", "ring,fast"], "--algorithms"),
    (["bench", "comm", "--nproc", "1"], "--nproc"),
    (["bench", "comm", "--sizes", "1Q"], "--sizes"),
    (["bench", "comm", "--nproc", "4", "--nodes", "3"], "--nodes"),
    (["bench", "comm", "--nodes", "2", "--inter-gbps", "-1"], "--inter-gbps"),
    (["bench", "comm", "--burst", "0"], "--burst"),
    (["bench", "comm", "--iters", "0"], "--iters"),  # was silently 3
    (["bench", "comm", "--warmup", "-1"], "--warmup"),
    (["schedule", "--pp", "2", "--microbatches", "4", "--virtual", "0"], "--virtual: must be >= 1, got 0"),  # was the default
    (["schedule", "--pp", "0", "--microbatches", "4"], "--pp: must be >= 1, got 0"),
    (["schedule", "--pp", "2", "--microbatches", "4", "--cost", "1,1"], "give three numbers"),
    (["schedule", "--pp", "2", "--microbatches", "4", "--cost", "1,-1,1"], "positive"),  # was simulated
    (["schedule", "--pp", "2", "--microbatches", "4", "--cost", "0,0,0"], "positive"),  # was a traceback
    (["schedule", "--pp", "4", "--microbatches", "3", "--schedule", "interleaved"], "--schedule: microbatches=3 < pp=4"),
])
def test_bad_arguments_fail_before_spawning(argv, msg, capsys):
    assert cli.main(argv) == 2
    assert msg in capsys.readouterr().err
