"""Global tensors from every rank's pieces: ``full_state`` for tests, tools and small models.

Checkpoints never use this (each rank writes and reads its own boxes: checkpoint/save.py).
Here every rank's :class:`~.regions.Piece` s are exchanged with two tensor all-gathers over the
world -- a JSON description and the raw bytes, padded to the longest rank's -- and assembled into
whole tensors. No pickle, and the collectives run on the mesh's device (NCCL takes no CPU
tensors). It holds the whole state on the assembling ranks: a debugging and testing aid.
"""
from __future__ import annotations

import json

import torch

from ..distributed.regions import Piece

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                               torch.int32, torch.uint8, torch.bool)}


def _encode(pieces: list[Piece]) -> tuple[bytes, torch.Tensor]:
    desc, blobs = [], []
    for p in pieces:
        t = p.tensor.detach().contiguous().cpu()
        desc.append([p.key, list(p.global_shape), list(p.offsets), list(t.shape), str(t.dtype)])
        blobs.append(t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8))
    payload = torch.cat(blobs) if blobs else torch.zeros(0, dtype=torch.uint8)
    return json.dumps(desc).encode(), payload


def _exchange(pieces: list[Piece], mesh) -> list[tuple[list, torch.Tensor]]:
    header, payload = _encode(pieces)
    if mesh.world_size == 1:
        return [(json.loads(header), payload)]
    comm, dev = mesh.comm("world"), mesh.device
    sizes = comm.all_gather(torch.tensor([[len(header), payload.numel()]], dtype=torch.int64, device=dev)).cpu()
    width = int((sizes[:, 0] + sizes[:, 1]).max())
    buf = torch.zeros(1, width, dtype=torch.uint8)
    buf[0, :len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    buf[0, len(header):len(header) + payload.numel()] = payload
    every = comm.all_gather(buf.to(dev)).cpu()
    out = []
    for r in range(every.shape[0]):
        h, n = int(sizes[r, 0]), int(sizes[r, 1])
        out.append((json.loads(bytes(every[r, :h].tolist())), every[r, h:h + n]))
    return out


def gather_pieces(pieces: list[Piece], mesh, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's pieces: on rank 0 (every rank with ``everywhere``; the
    others get an empty dict). Collective over the world. Raises if a tensor is not covered."""
    ranks = _exchange(pieces, mesh)
    if not everywhere and mesh.rank != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for desc, payload in ranks:
        pos = 0
        for key, gshape, offsets, shape, dtype in desc:
            dt = _DTYPES[dtype]
            n = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            value = payload[pos:pos + n].clone().view(dt).reshape(shape)  # clone: aligned storage
            pos += n
            if key not in out:
                out[key] = torch.zeros(gshape, dtype=dt)
                covered[key] = torch.zeros(gshape, dtype=torch.bool)
            box = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
            out[key][box] = value
            covered[key][box] = True
    for key, c in covered.items():
        if not bool(c.all()):
            raise RuntimeError(f"state: the ranks' pieces of {key} do not cover the global tensor "
                               f"({int(c.sum())} of {c.numel()} elements)")
    return out
