"""Checkpoints reshard: train K steps under layout A, save, resume under layout B (another layout,
another world size: 4 -> 2, 2 -> 3) for K more; the losses equal an uninterrupted
single-process run (float64, <= 1e-10)."""
import json

import pytest

from shardlab import config as C
from shardlab.analysis.verify import BASE, MOE, reference
from shardlab.cli import main as cli_main
from shardlab.train.data import prepare

K = 2


def _args(parallel: dict, model: dict, tmp, steps: int, resume: bool):
    out = []
    for section, values in (("model", {**BASE["model"], **model}), ("train", {**BASE["train"], "steps": steps}),
                            ("logging", {**BASE["logging"], "log_every": 1}), ("parallel", parallel)):
        out += [f"--{section}.{k}={v}" for k, v in values.items()]
    out += [f"--data.cache_dir={tmp}/cache", f"--logging.run_dir={tmp}/run", f"--checkpoint.every={K}",
            "--train.eval_every=0"]
    return out + (["--resume"] if resume else [])


def _losses(tmp):
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


PAIRS = {
    "tp2xdp2->pp2xdp2": ({"tp": 2, "dp_replicate": 2}, {"pp": 2, "dp_replicate": 2, "microbatches": 2}, {}),
    "ep4->ep2xdp2": ({"ep": 4, "dp_shard": 4}, {"ep": 2, "dp_shard": 4}, MOE),
    "dp4->fsdp2": ({"dp_replicate": 4}, {"dp_shard": 2, "zero_stage": 3}, {}),
    "fsdp4->tp2xfsdp2": ({"dp_shard": 4, "zero_stage": 3}, {"tp": 2, "dp_shard": 2, "zero_stage": 3}, {}),
    "cp2xdp2->tp4": ({"cp": 2, "dp_replicate": 2}, {"tp": 4}, {}),
    # world-size changes: 4 ranks -> 2, 2 ranks -> 3 (uneven pipeline stages, ZeRO-2 shards to PP)
    "zero2x4->tp2": ({"dp_shard": 4, "zero_stage": 2}, {"tp": 2}, {}),
    "fsdp2->pp3": ({"dp_shard": 2, "zero_stage": 3}, {"pp": 3, "microbatches": 4}, {}),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_resume_under_another_layout(tmp_path, name):
    a, b, model = PAIRS[name]
    nproc = {k: C.from_dict({"parallel": p}).parallel.world_size for k, p in (("a", a), ("b", b))}
    assert cli_main(["train", "--nproc", str(nproc["a"]), *_args(a, model, tmp_path, K, False)]) == 0
    assert cli_main(["train", "--nproc", str(nproc["b"]), *_args(b, model, tmp_path, 2 * K, True)]) == 0
    got = _losses(tmp_path)
    cfg = C.from_dict({**BASE, "model": {**BASE["model"], **model}, "train": {**BASE["train"], "steps": 2 * K},
                       "data": {"cache_dir": str(tmp_path / "cache")}})
    ref, _ = reference(cfg, str(prepare(cfg.data)), 2 * K)
    assert sorted(got) == list(range(1, 2 * K + 1))
    diffs = [abs(got[s + 1] - ref[s]) for s in range(2 * K)]
    assert max(diffs) <= 1e-10, diffs
