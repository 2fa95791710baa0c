"""Autoregressive generation for any model whose ``forward(tokens, cache=...)`` returns logits
(B, S, V): greedy or sampled (temperature, top-k, seeded), stopping at an end-of-sequence id, with
a :class:`KVCache` or (the reference) recomputing the whole sequence per token. Under tensor
parallel every rank runs this loop on its shard: ``comm`` (the tp group) all-gathers the last
position's vocab slices, so every rank picks the same token without a broadcast (docs/pretrained.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


class LayerCache:
    """Keys and values of one attention layer, (B, H, S, D), grown along S."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v):
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


class KVCache:
    """Per-layer caches plus the number of tokens they hold (the next token's position)."""

    def __init__(self):
        self.layers: dict[str, LayerCache] = {}
        self.length = 0

    def layer(self, key) -> LayerCache:
        return self.layers.setdefault(str(key), LayerCache())

    def advance(self, n: int) -> None:
        self.length += n


@dataclass
class Generation:
    tokens: list[int]
    """The new tokens (the stop token included when one ended the run)."""
    seconds: float = 0.0
    """Wall time of the decode loop (prompt included)."""
    prefill_seconds: float = 0.0
    stopped: bool = False
    """A ``stop_ids`` token ended the run."""
    full: bool = False
    """The model's positions (``max_len``) ran out before ``max_new_tokens``."""
    per_token: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    """With ``keep_logits``: the full (V,) logits each token was picked from (tests compare them)."""

    @property
    def ms_per_token(self) -> float:
        """Mean time per new token after the first (the decode steps; the prompt is excluded)."""
        steps = self.per_token[1:]
        return 1000.0 * sum(steps) / len(steps) if steps else float("nan")


def pick(logits: torch.Tensor, temperature: float, top_k: int, generator) -> int:
    """The next token from the last position's logits (V,): argmax when temperature <= 0, else a
    sample of softmax(logits / T) restricted to the top k (k <= 0: all)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def full_logits(local: torch.Tensor, comm=None, vocab_size: int | None = None) -> torch.Tensor:
    """The (V,) logits of one position: ``local`` itself, or under tensor parallel the tp ranks'
    vocab slices gathered in rank order with the padding rows of the last slice cut off."""
    if comm is None or comm.size == 1:
        return local
    full = comm.all_gather(local.contiguous(), dim=0)
    return full[:vocab_size] if vocab_size is not None else full


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop_ids=(), use_cache: bool = True, max_len: int | None = None,
             comm=None, vocab_size: int | None = None, keep_logits: bool = False) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; stops after emitting a ``stop_ids`` token.
    ``comm``/``vocab_size``: the tp group and the true vocabulary size of a tensor-parallel shard
    (module doc); every rank of the group must call this with the same arguments."""
    if not prompt_ids:
        raise ConfigError("--prompt", "the prompt encodes to no tokens")
    if max_len is not None and len(prompt_ids) >= max_len:
        raise ConfigError("--prompt", f"{len(prompt_ids)} tokens fill the model's {max_len} positions "
                                      "(model.max_seq_len), leaving none to generate; shorten the prompt")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = list(prompt_ids)
    cache = KVCache() if use_cache else None
    out = Generation([])
    start = time.perf_counter()
    feed = seq
    for _ in range(max_new_tokens):
        if max_len is not None and len(seq) >= max_len:
            out.full = True
            break
        t0 = time.perf_counter()
        x = torch.tensor([feed], dtype=torch.long, device=device)
        logits = model(x, cache=cache) if use_cache else model(x)
        last = full_logits(logits[0, -1], comm, vocab_size).cpu()
        if keep_logits:
            out.logits.append(last.clone())
        nxt = pick(last, temperature, top_k, gen)
        out.per_token.append(time.perf_counter() - t0)
        out.tokens.append(nxt)
        seq.append(nxt)
        feed = [nxt] if use_cache else seq
        if nxt in stop_ids:
            out.stopped = True
            break
    out.seconds = time.perf_counter() - start
    out.prefill_seconds = out.per_token[0] if out.per_token else 0.0
    return out

