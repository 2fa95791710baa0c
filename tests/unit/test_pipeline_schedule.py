"""Pipeline schedules and their simulator: known bubble fractions, memory bounds, deadlock
detection, clear errors. Pure Python (no processes)."""
import argparse
import itertools

import pytest

from shardlab.parallel.pipeline.schedule import (Action, Schedule, ScheduleError, build,
                                                 theoretical_bubble)
from shardlab.parallel.pipeline.simulate import check, simulate


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3])  # multiples of p
def test_gpipe_and_1f1b_bubble(p, m):
    m = m * p
    for name in ("gpipe", "1f1b"):
        res = check(build(name, p, m))
        assert res.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert res.makespan == pytest.approx(3 * (m + p - 1))
    # memory: GPipe holds all m micro-batches, 1F1B at most p - r on rank r
    assert simulate(build("gpipe", p, m)).peak_inflight == [m] * p
    assert simulate(build("1f1b", p, m)).peak_inflight == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2)])
def test_interleaved_bubble(p, m, v):
    res = check(build("interleaved", p, m, v))
    assert res.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    # ideal step m*(F+B+W) plus (p-1)(F+B+W)/v of bubble
    assert res.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
def test_zb_h1_bubble_and_memory(p, m):
    res = check(build("zb-h1", p, m))
    # idle per rank (p-1)(F+B-W) = p-1 with unit costs, against 1F1B's 3(p-1)
    assert res.makespan == pytest.approx(3 * m + (p - 1))
    assert res.bubble == pytest.approx(theoretical_bubble("zb-h1", p, m), abs=1e-12)
    assert res.bubble < simulate(build("1f1b", p, m)).bubble
    assert res.peak_inflight == [p - r for r in range(p)]          # 1F1B's activation bound
    assert all(h <= 2 * p - r - 1 for r, h in enumerate(res.peak_held))


def test_split_costs_change_bubble():
    # with F=1, B=2, W=0.5 the formulas still hold
    res = check(build("1f1b", 4, 8), f=1, b=2, w=0.5)
    assert res.bubble == pytest.approx(theoretical_bubble("1f1b", 4, 8, 1, 1, 2, 0.5))


def test_broken_list_is_a_deadlock():
    s = build("1f1b", 2, 2)
    # rank 1 waits for gradient of micro-batch 1 before it receives micro-batch 0's activation...
    # simplest break: both ranks receive first. Rank 0 waits for a gradient it never gets first.
    r0 = [Action("RECV_B", 0, 0, 1)] + [a for a in s.ranks[0] if a != Action("RECV_B", 0, 0, 1)]
    broken = Schedule("broken", 2, 2, 1, False, [r0, s.ranks[1]])
    res = simulate(broken)
    assert not res.ok and res.reason.startswith("deadlock")
    assert "rank 0 waits at action 0 (RECV_B0s0>r1)" in res.reason
    with pytest.raises(ScheduleError, match="refused: deadlock"):
        check(broken)


def test_swapped_send_order_between_ranks_deadlocks():
    # rank 1 consumes micro-batch 1 before 0 while rank 0 produces 0 first: fine (tags), but if
    # rank 0 also waits on micro-batch 1's gradient before sending 1's activation: cycle.
    s = build("gpipe", 2, 2)
    r0 = [Action("F", 0, 0), Action("SEND_F", 0, 0, 1), Action("RECV_B", 1, 0, 1), Action("B", 1, 0),
          Action("SEND_B", 1, 0, 1), Action("F", 1, 0), Action("SEND_F", 1, 0, 1),
          Action("RECV_B", 0, 0, 1), Action("B", 0, 0)]
    res = simulate(Schedule("broken", 2, 2, 1, False, [r0, s.ranks[1]]))
    assert not res.ok and "deadlock" in res.reason


def test_invalid_lists_are_refused():
    s = build("1f1b", 2, 2)
    no_b = [[a for a in s.ranks[0] if not (a.kind == "B" and a.mb == 1)], s.ranks[1]]
    res = simulate(Schedule("x", 2, 2, 1, False, no_b))
    assert not res.ok  # a gradient sent to rank 0 is never received
    wrong = [[Action("B", 0, 0)] + s.ranks[0], s.ranks[1]]
    assert "backward before its forward" in simulate(Schedule("x", 2, 2, 1, False, wrong)).reason


def test_count_errors():
    with pytest.raises(ScheduleError, match="microbatches=2 < pp=4"):
        build("1f1b", 4, 2)
    with pytest.raises(ScheduleError, match="divisible by pp=4"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build("zb-v", 2, 2)
    with pytest.raises(ScheduleError, match="virtual stages"):
        build("1f1b", 2, 2, 2)


def test_schedule_command(tmp_path, capsys):
    from shardlab.commands import schedule_cmd
    ap = argparse.ArgumentParser()
    schedule_cmd.configure(ap)
    out = tmp_path / "t.png"
    assert schedule_cmd.main(ap.parse_args(["--pp", "4", "-m", "8", "--schedule", "zb-h1", "--out", str(out)])) == 0
    text = capsys.readouterr().out
    assert "theoretical 0.1111   simulated 0.1111" in text and "rank 3 |" in text
    assert out.stat().st_size > 1000
    from shardlab import cli
    assert cli.main(["schedule", "--pp", "4", "-m", "6", "--schedule", "interleaved"]) == 2
    assert "config error: --schedule: interleaved needs microbatches divisible by pp=4" in capsys.readouterr().err


# -- stage partition (pure, single process) -------------------------------------------------------

def test_partition_balances_parameter_count():
    from shardlab.parallel.pipeline.stage import partition
    assert partition([1] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # embedding and head weigh on the end stages: they get fewer layers (uneven split)
    parts = partition([10] * 8, 4, first_extra=10, last_extra=20)
    sizes = [10 * len(r) + 10 * (i == 0) + 20 * (i == 3) for i, r in enumerate(parts)]
    assert max(sizes) == 30 and len(parts[3]) == 1 and sum(map(len, parts)) == 8
    assert [r.start for r in parts] == sorted(r.start for r in parts) and parts[0].start == 0
    assert partition([1] * 5, 2) in ([range(0, 2), range(2, 5)], [range(0, 3), range(3, 5)])
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        partition([1] * 3, 4)


def test_stage_views_chain_to_the_full_model():
    import torch

    from shardlab.config import ModelConfig
    from shardlab.models import build_model, get_spec
    from shardlab.parallel.pipeline.stage import split_model
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=6, n_heads=4, max_seq_len=16)
    full = build_model(cfg, 3, dtype=torch.float64)
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    want = full(x, y)
    p, v = 2, 2
    parts = [split_model(build_model(cfg, 3, dtype=torch.float64), get_spec(cfg), r, p, v) for r in range(p)]
    h = x
    for s in range(p * v):
        chunk = parts[s % p][1][s]
        h = chunk(h, y if s == p * v - 1 else None)
    assert torch.allclose(h, want, atol=1e-12, rtol=0)
    # each rank keeps only its own layers, under their global names
    names0 = {n for n, _ in parts[0][0].named_parameters()}
    assert "tok_embeddings.weight" in names0 and "output.weight" not in names0
    ranges = parts[0][2]
    assert all(f"layers.{i}.attention.wq.weight" in names0 for s in (0, 2) for i in ranges[s])
    assert not any(f"layers.{i}." in n for n in names0 for s in (1, 3) for i in ranges[s])


def test_config_errors_before_any_process():
    from shardlab.config import Config, ConfigError
    for changes, field in (({"microbatches": 2}, "parallel.microbatches"),
                           ({"pp_schedule": "interleaved", "pp_virtual": 2, "microbatches": 6}, "parallel.microbatches"),
                           ({"pp_virtual": 2}, "parallel.pp_virtual")):
        cfg = Config()
        cfg.model.n_layers, cfg.parallel.pp, cfg.parallel.microbatches = 8, 4, 4
        cfg.train.global_batch = 48
        for k, v in changes.items():
            setattr(cfg.parallel, k, v)
        with pytest.raises(ConfigError) as e:
            cfg.validate()
        assert e.value.field == field
    cfg = Config()
    cfg.parallel.pp, cfg.parallel.microbatches, cfg.model.tie_embeddings = 2, 2, True
    with pytest.raises(ConfigError, match="tie_embeddings"):
        cfg.validate()


def test_per_stage_costs():
    # GPipe, p = 2, m = 2; stage 1 twice as slow: rank 1 runs F0 [1,3] F1 [3,5] B0 [5,9] B1 [9,13],
    # rank 0 waits for each gradient: B0 [9,11], B1 [13,15]
    res = check(build("gpipe", 2, 2), stage_costs={0: {"F": 1, "B": 2}, 1: {"F": 2, "B": 4}})
    assert res.makespan == 15 and res.bubble == pytest.approx(1 - 18 / 30)
    assert [(str(a), s, e) for a, s, e in res.timeline[0]][-1] == ("B1s0", 13, 15)


def test_stage_views_follow_replaced_blocks():
    import torch

    from shardlab.config import ModelConfig
    from shardlab.models import build_model, get_spec
    from shardlab.parallel.pipeline.stage import split_model, stage_views
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=16)
    model, chunks, ranges = split_model(build_model(cfg, 3), get_spec(cfg), 0, 2)
    key = str(ranges[0][0])
    model.layers[key] = torch.nn.Sequential()  # e.g. a wrapper applied after the split
    assert chunks[0].layers[key] is not model.layers[key]
    assert stage_views(model, get_spec(cfg), ranges, [0])[0].layers[key] is model.layers[key]


def test_shared_cores_hand_computed():
    # GPipe, p = 2, m = 2, F = 1, B = 2 (unsplit), both ranks on 1 core. Rank 0: F0 [0,1] alone;
    # F1 and rank 1's F0 share the core (rate 1/2): both [1,3]; rank 1: F1 [3,4], B0 [4,6] alone;
    # rank 0's B0 and rank 1's B1 share: both [6,10]; rank 0: B1 [10,12]. Busy 9 per rank.
    res = check(build("gpipe", 2, 2), cores=1)
    spans = [[(str(a), s, e) for a, s, e in tl] for tl in res.timeline]
    assert spans == [[("F0s0", 0, 1), ("F1s0", 1, 3), ("B0s0", 6, 10), ("B1s0", 10, 12)],
                     [("F0s1", 1, 3), ("F1s1", 3, 4), ("B0s1", 4, 6), ("B1s1", 6, 10)]]
    assert res.makespan == 12 and res.bubble == pytest.approx(1 - 18 / 24)
    # with a hop of 0.5: rank 0's F1 runs alone [1,1.5], shares [1.5,2.5] with rank 1's F0,
    # which finishes alone at 3; F1s1 [3,4] (sent 2.5 + 0.5); B0s1 [4,6]; B1s1 alone [6,6.5],
    # shared until 9.5; rank 0's B0 [6.5,10] (0.5 left at 9.5, alone); B1s0 [10,12]. Busy 8 each.
    res = check(build("gpipe", 2, 2), cores=1, comm=0.5)
    spans = [x for tl in res.timeline for _, s, e in tl for x in (s, e)]
    assert spans == pytest.approx([0, 1, 1, 2.5, 6.5, 10, 10, 12, 1.5, 3, 3, 4, 4, 6, 6, 9.5])
    assert res.makespan == pytest.approx(12) and res.bubble == pytest.approx(1 - 16 / 24)
    # run to completion: at t = 1 rank 0's F1 and rank 1's F0 are both ready, rank 0 goes first
    # (tie: lower rank); F0s1 waits [1,2] idle. At t = 6 rank 0's B0 and rank 1's B1 tie again.
    res = check(build("gpipe", 2, 2), cores=1, sharing="fifo")
    spans = [[(str(a), s, e) for a, s, e in tl] for tl in res.timeline]
    assert spans == [[("F0s0", 0, 1), ("F1s0", 1, 2), ("B0s0", 6, 8), ("B1s0", 10, 12)],
                     [("F0s1", 2, 3), ("F1s1", 3, 4), ("B0s1", 4, 6), ("B1s1", 8, 10)]]
    assert res.makespan == 12 and res.bubble == pytest.approx(1 - 12 / 24)


@pytest.mark.parametrize("name,p,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
                                      ("zb-h1", 4, 1), ("dualpipev", 4, 1), ("dualpipe", 4, 1)])
def test_shared_cores_enough_cores_is_one_core_per_rank(name, p, v):
    # the event-driven run with a core for every rank gives the per-rank-clock timeline, also with
    # uneven measured-like costs and a hop latency; fewer cores: never faster than total work / cores
    s = build(name, p, 8, v)
    costs = {st: {"F": 1 + 0.1 * st, "B": 2 - 0.2 * (st % 3), "W": 0.7 + 0.05 * st} for st in range(s.n_stages)}
    for kw in ({}, {"stage_costs": costs, "comm": 0.3}):
        ref = simulate(s, **kw)
        for cores, sharing in itertools.product((p, p + 1), ("ps", "fifo")):
            got = simulate(s, cores=cores, sharing=sharing, **kw)
            assert got.makespan == pytest.approx(ref.makespan) and got.bubble == pytest.approx(ref.bubble)
            assert [[(a, st, e) for a, st, e in tl] for tl in got.timeline] == \
                [[(a, pytest.approx(st), pytest.approx(e)) for a, st, e in tl] for tl in ref.timeline]
        work = sum(e - st for tl in ref.timeline for _, st, e in tl)
        for sharing in ("ps", "fifo"):
            one = simulate(s, cores=1, sharing=sharing, **kw)
            assert one.makespan >= work - 1e-9 and one.peak_inflight == ref.peak_inflight
            # fewer cores than ranks: never faster than a core each (the per-rank-clock run is the
            # earliest every action can start)
            assert simulate(s, cores=p - 1, sharing=sharing, **kw).makespan >= ref.makespan - 1e-9
        # one core, run to completion: never two actions at once, each lasts exactly its cost
        spans = sorted((st, e) for tl in one.timeline for _, st, e in tl)
        assert all(e0 <= s1 + 1e-9 for (_, e0), (s1, _) in zip(spans, spans[1:]))
        assert sum(e - st for st, e in spans) == pytest.approx(work)
