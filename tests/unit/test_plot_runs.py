"""metrics.jsonl after a killed run (its last record cut off mid-line), and several runs in one
picture: `shardlab plot` used to end in a JSONDecodeError traceback on the first, and took one run."""
import json

from shardlab.cli import main as cli_main
from shardlab.train.metrics import MetricsWriter, read_metrics
from shardlab.train.plot import _curves


def _run(d, losses, layout="dp_replicate=2", cut=False):
    d.mkdir(parents=True)
    lines = [json.dumps({"kind": "start", "step": 0, "layout": layout})]
    lines += [json.dumps({"kind": "train", "step": s, "loss": v}) for s, v in enumerate(losses, 1)]
    text = "\n".join(lines) + "\n" + ('{"kind": "train", "step": 9, "lo' if cut else "")
    (d / "metrics.jsonl").write_text(text)
    return d


def test_a_record_cut_off_by_a_kill_is_left_out_and_said(tmp_path, capsys):
    run = _run(tmp_path / "a", [5.0, 4.0, 3.5], cut=True)
    skipped = []
    assert [r.get("loss") for r in read_metrics(run, skipped)] == [None, 5.0, 4.0, 3.5] and skipped == [5]
    assert cli_main(["plot", str(run)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(run / "loss.png") and (run / "loss.png").stat().st_size > 1000
    assert "left out 1 unreadable line(s) (line 5" in err
    # a resumed run appends after the fragment on a line of its own: every whole record stays readable
    w = MetricsWriter(run, tensorboard=False)
    w.write({"kind": "train", "step": 4, "loss": 3.0})
    w.close()
    skipped = []
    assert [r.get("loss") for r in read_metrics(run, skipped)][-1] == 3.0 and skipped == [5]


def test_a_file_of_no_records_is_one_line(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("garbage\n")
    assert cli_main(["plot", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == (f"config error: RUN_DIR: {tmp_path / 'r' / 'metrics.jsonl'} holds no "
                                               "metrics records (line 1 is not a JSON object); pass a directory "
                                               "written by `shardlab train`")


def test_several_runs_in_one_picture(tmp_path, capsys):
    a = _run(tmp_path / "a", [5.0, 4.0], "dp_replicate=2")
    b = _run(tmp_path / "b", [5.0, 3.0, 2.5], "tp=2")
    assert cli_main(["plot", str(a), str(b)]) == 2  # one picture of two runs needs a name
    assert "--out: 2 runs are drawn into one picture" in capsys.readouterr().err
    assert not (a / "loss.png").exists()
    assert cli_main(["plot", str(a), str(b), "--out", str(tmp_path / "cmp.png")]) == 0
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    assert _curves(b)[0] == [(1, 5.0), (2, 3.0), (3, 2.5)] and _curves(b)[2]["layout"] == "tp=2"
