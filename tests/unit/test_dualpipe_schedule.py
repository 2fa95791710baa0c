"""DualPipe / DualPipeV schedules as data: every micro-batch's F, B, W exactly once per stage of
its path on the stage's rank, dependencies respected (the simulator runs them without deadlock),
receives in send order, bubble against the published formula, memory, count and config errors.
Pure Python (no processes)."""
import argparse
import itertools

import pytest

from shardlab.parallel.pipeline.schedule import ScheduleError, build, theoretical_bubble
from shardlab.parallel.pipeline.simulate import check, simulate
from shardlab.parallel.pipeline.stage import check_p2p_order

CASES = [("dualpipev", p, m) for p in (1, 2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 4 * p)] + \
        [("dualpipe", p, m) for p in (2, 4, 6, 8) for m in (2 * p, 2 * p + 2, 4 * p)]


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_action_once_on_its_rank(name, p, m):
    s = build(name, p, m)
    assert s.split_bw and s.v == 2 and s.n_stages == 2 * p
    for r in range(p):  # rank r holds stage r and stage id 2p-1-r
        assert s.stages_of(r) == [r, 2 * p - 1 - r]
    want = sorted((k, j, st) for k in "FBW" for j in range(m) for st in s.path(j))
    got = sorted((a.kind, a.mb, a.stage) for acts in s.ranks for a in acts if a.kind in "FBW")
    assert got == want
    for r, acts in enumerate(s.ranks):
        assert all(s.rank_of(a.stage) == r for a in acts if a.kind in "FBW")
    check(s)            # dependencies: no F before its input, no B before its output gradient, no W before B
    check_p2p_order(s)  # receives in send order (messages matched by issue order)


def test_paths():
    v, d = build("dualpipev", 4, 8), build("dualpipe", 4, 8)
    assert list(v.path(5)) == list(range(8)) and v.prev_stage(4) == 3 and v.rank_of(4) == 3
    assert list(d.path(0)) == [0, 1, 2, 3] and list(d.path(4)) == [4, 5, 6, 7]
    assert d.prev_stage(4) is None and d.next_stage(3) is None and d.rank_of(4) == 3
    # the V's turn (stage 3 -> 4, both on rank 3) needs no message
    assert not any(a.kind.startswith(("SEND", "RECV")) and a.stage in (3, 4) and a.peer == 3
                   for a in v.ranks[3])


@pytest.mark.parametrize("name,p", [("dualpipev", 2), ("dualpipev", 4), ("dualpipev", 8),
                                    ("dualpipe", 4), ("dualpipe", 8), ("dualpipe", 16)])
def test_bubble_against_published_formula(name, p):
    k = p - 1 if name == "dualpipev" else p // 2 - 1  # PP/2 - 1, PP = stages of the pipe
    chunk = 0.5 if name == "dualpipev" else 1.0      # a V chunk is half a rank's share
    for m in (2 * p, 4 * p):
        s = build(name, p, m)
        res = check(s)
        # F = B = W: every rank idles exactly (PP/2 - 1) chunk-forwards, the same on every rank
        idle = [res.makespan - sum(e - t for _, t, e in tl) for tl in res.timeline]
        assert idle == pytest.approx([k * chunk] * p)
        assert res.bubble < simulate(build("zb-h1", p, m)).bubble < simulate(build("1f1b", p, m)).bubble
        # the published (PP/2-1)(F&B + B - 3W), F&B run as F then B: never exceeded (W <= F, B)
        for f, b, w in itertools.product((0.5, 1, 2), (0.5, 1, 2), (0.25, 0.5, 1, 2)):
            if w > min(f, b) or f > b + w:  # a forward costs at most a full backward
                continue
            r = simulate(s, f=f, b=b, w=w)
            assert r.bubble <= theoretical_bubble(name, p, m, 1, f, b, w) + 1e-12, (f, b, w)
    # and the formula itself: (PP/2-1)(F + 2B - W) in chunk units (F&B = F + B + W, B_full = B + W)
    work = 8 * p * (1 + 2 + 1)
    idle = k * (1 + 2 * 2 - 1) * chunk
    assert theoretical_bubble(name, p, 8 * p, 1, 1, 2, 1) == pytest.approx(idle / (work + idle))


def test_memory_pp_plus_one_chunks():
    # DeepSeek's table: activations PP + 1 (in chunks: stages of the pipe) on every rank
    for name, p in (("dualpipev", 4), ("dualpipe", 4), ("dualpipe", 8)):
        res = check(build(name, p, 4 * p))
        pp = 2 * p if name == "dualpipev" else p
        assert res.peak_inflight == [pp + 1] * p


def test_count_and_config_errors():
    with pytest.raises(ScheduleError, match="microbatches >= 2\\*pp = 8"):
        build("dualpipev", 4, 6)
    with pytest.raises(ScheduleError, match="even pp"):
        build("dualpipe", 3, 6)
    with pytest.raises(ScheduleError, match="even pp"):
        build("dualpipe", 4, 9)
    from shardlab.config import Config, ConfigError
    for changes, field in (({"pp_schedule": "dualpipev", "microbatches": 6}, "parallel.microbatches"),
                           ({"pp_schedule": "dualpipe", "microbatches": 8, "zero_stage": 1}, "parallel.zero_stage"),
                           ({"pp_schedule": "dualpipe", "microbatches": 12, "pp": 3}, "parallel.pp"),
                           ({"pp_schedule": "1f1b", "microbatches": 8, "pp_overlap": True}, "parallel.pp_overlap"),
                           ({"pp": 1, "pp_overlap": True}, "parallel.pp_overlap")):
        cfg = Config()
        cfg.model.n_layers, cfg.parallel.pp, cfg.train.global_batch = 8, 4, 48
        for key, value in changes.items():
            setattr(cfg.parallel, key, value)
        with pytest.raises(ConfigError) as e:
            cfg.validate()
        assert e.value.field == field
    cfg = Config()  # dualpipe is executed now: validates (two copies of 4 parts of 8 layers)
    cfg.model.n_layers, cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.microbatches = 8, 4, "dualpipe", 8
    cfg.train.global_batch = 8
    cfg.validate()
    cfg = Config()  # 2*pp stages need 2*pp layers
    cfg.model.n_layers, cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.microbatches = 6, 4, "dualpipev", 8
    cfg.train.global_batch = 8
    with pytest.raises(ConfigError, match="8 stages"):
        cfg.validate()


def test_schedule_command(capsys):
    from shardlab.commands import schedule_cmd
    ap = argparse.ArgumentParser()
    schedule_cmd.configure(ap)
    assert schedule_cmd.main(ap.parse_args(["--pp", "4", "-m", "8", "--schedule", "dualpipev"])) == 0
    text = capsys.readouterr().out
    assert "simulated 0.0588" in text and "4.5 4.5 4.5 4.5" in text and "rank 3 |" in text
    assert schedule_cmd.main(ap.parse_args(["--pp", "4", "-m", "8", "--schedule", "dualpipe"])) == 0
    assert "simulated 0.0400" in capsys.readouterr().out
    from shardlab import cli
    assert cli.main(["schedule", "--pp", "3", "-m", "6", "--schedule", "dualpipe"]) == 2
    assert "config error: --schedule: dualpipe needs an even pp" in capsys.readouterr().err
