"""A user's own text as the corpus (data.dataset = a path): an empty file, one shorter than a
global batch of windows, one whose validation split is: one line naming the field and the fix,
exit 2, before any rank starts and before the run directory is made (an empty file used to end in
numpy's "cannot mmap an empty file" traceback, the others in a rank's error without the numbers)."""
import re

import pytest

from shardlab.cli import main as cli_main
from shardlab.config import ConfigError
from shardlab.train.data import check_windows

TINY = "configs/tiny.toml"  # bytes, seq_len 128, global batch 16


def _train(tmp_path, text: bytes, *extra):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(text)
    argv = ["train", TINY, "--nproc", "1", "--run-dir", str(tmp_path / "run"), f"--data.dataset={corpus}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--train.steps=1", *extra]
    return cli_main(argv), corpus


@pytest.mark.parametrize("size, field", [(0, "data.dataset"), (1, "data.dataset"), (1000, "data.dataset"),
                                         (5000, "data.val_fraction")])
def test_a_corpus_too_small_for_one_batch_is_one_line_before_the_start(tmp_path, capsys, size, field):
    rc, corpus = _train(tmp_path, bytes(range(97, 123)) * (size // 26) + b"x" * (size % 26))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith(f"config error: {field}: ") and str(corpus) in err, err
    assert not (tmp_path / "run").exists()


def test_the_suggested_validation_share_is_enough(tmp_path, capsys):
    """5,000 bytes: 5% validation is 250 tokens, one window; the share the message suggests
    trains (2 windows short of it are refused by the same rule, counted independently here)."""
    rc, _ = _train(tmp_path, b"To be or not to be. " * 250)
    err = capsys.readouterr().err
    share = float(re.search(r"raise data.val_fraction \(to ([0-9.]+) or more\)", err).group(1))
    val = int(5000 * share)
    assert rc == 2 and (val - 1) // 128 >= 16 and (int(5000 * (share - 0.01)) - 1) // 128 < 16
    assert _train(tmp_path, b"To be or not to be. " * 250, f"--data.val_fraction={share}",
                  "--train.eval_batches=1")[0] == 0


def test_the_loader_keeps_the_same_rule():
    check_windows(16 * 128 + 1, 16 * 128 + 1, 128, 16)  # exactly one batch each: fine
    for train, val, field in ((16 * 128, 10**6, "data.dataset"), (10**6, 16 * 128, "data.val_fraction")):
        with pytest.raises(ConfigError) as e:
            check_windows(train, val, 128, 16)
        assert e.value.field == field


def test_an_edited_corpus_of_the_same_size_is_tokenised_again(tmp_path):
    """The cache was keyed by file name and size: a same-size edit trained on the old tokens."""
    import os

    import numpy as np

    from shardlab.config import DataConfig
    from shardlab.train.data import prepare
    corpus = tmp_path / "corpus.txt"
    cfg = DataConfig(dataset=str(corpus), cache_dir=str(tmp_path / "cache"))
    corpus.write_bytes(b"To be or not to be. " * 100)
    first = np.fromfile(prepare(cfg) / "train.bin", dtype=np.uint16)
    st = corpus.stat()
    corpus.write_bytes(b"Zo ze zr zot zo ze. " * 100)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # a later change, even on a coarse clock
    second = np.fromfile(prepare(cfg) / "train.bin", dtype=np.uint16)
    assert bytes(first[:20].astype(np.uint8)) == b"To be or not to be. "
    assert bytes(second[:20].astype(np.uint8)) == b"Zo ze zr zot zo ze. "
