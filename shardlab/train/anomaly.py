"""Finding the first non-finite value (``train.detect_anomaly = "first_module"``): hooks on every
module note the first one that makes an inf/nan out of finite values (forward, backward, or a
parameter's gradient); :meth:`Detector.agree` gives every rank the lowest rank's note, and the
loop treats the step as non-finite. A diagnosis mode: each hook syncs with the device, and the
full backward hooks change gradient sums at rounding level. Docs: docs/faults.md."""
from __future__ import annotations

import sys
import warnings

import torch


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _bad(x) -> str | None:
    """'nan' or 'inf' for the first floating tensor in ``x`` holding one, else None."""
    for t in _tensors(x):
        if t.is_floating_point() or t.is_complex():
            t = t.detach()
            if not bool(torch.isfinite(t).all()):
                return "nan" if bool(torch.isnan(t).any()) else "inf"
    return None


NOTE_BYTES = 1024
"""Longest note (UTF-8 bytes) one rank's detector sends the others."""


class Detector:
    """Hooks on every module of ``model``; ``first`` is the note of the first non-finite value."""

    def __init__(self, model: torch.nn.Module, rank: int):
        self.rank, self.step, self.first, self.tainted = rank, 0, None, set()
        self.handles = []
        # modules fed only integer ids (embeddings, the root) see output gradients only: expected
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                                  "respect to module outputs since no inputs require gradients")
        for name, module in model.named_modules():
            qual = name or type(module).__name__  # the root has no name of its own
            self.handles.append(module.register_forward_hook(self._edge(qual, "forward (its output)", True)))
            self.handles.append(module.register_full_backward_hook(
                self._edge(qual, "backward (the gradient of its input)", False)))
            self.handles.append(module.register_full_backward_pre_hook(self._taint(module)))
            for pname, p in module.named_parameters(recurse=False):
                if p.requires_grad:  # before accumulation, so before the engines' post-accumulate hooks
                    self.handles.append(p.register_hook(self._param(module, qual, pname)))

    def _note(self, name: str, where: str, kind: str) -> None:
        self.first = (f"non-finite value ({kind}) first produced by module '{name}' in {where} "
                      f"on rank {self.rank} at step {self.step}")

    def _edge(self, name, where: str, produced_second: bool):
        """A module hook ``hook(module, a, b)`` that notes ``name`` when the module turned finite
        values into non-finite ones: forward ``(inputs, output)`` produces the second, backward
        ``(grad_input, grad_output)`` the first. Fed a non-finite value, it is not the origin."""
        def hook(module, a, b):
            if self.first is None:
                produced, consumed = (b, a) if produced_second else (a, b)
                kind = _bad(produced)
                if kind and _bad(consumed) is None:
                    self._note(name, where, kind)
        return hook

    def _taint(self, module):
        def hook(module_, grad_output):  # handed a non-finite gradient: its parameters' are no news
            if self.first is None and _bad(grad_output):
                self.tainted.add(id(module))
        return hook

    def _param(self, module, name, pname):
        def hook(grad):
            if self.first is None and id(module) not in self.tainted:
                kind = _bad(grad)
                if kind:
                    self._note(name, f"backward (the gradient of its parameter '{pname}')", kind)
        return hook

    def begin(self, step: int) -> None:
        """Before the forward pass of training step ``step`` (1-based, as the loop reports it)."""
        self.step, self.first, self.tainted = step, None, set()

    def agree(self, comm, device) -> str | None:
        """Collective over ``comm`` (the Mesh's world; every rank calls it once per step): the
        note of the lowest rank that found a non-finite value, the same on every rank, or None.
        One small all-reduce; a broadcast of the note only when there is one."""
        if comm.size == 1:
            return self.first
        device = comm.control_device(device)
        first = torch.tensor([comm.size if self.first is None else comm.rank], dtype=torch.int64, device=device)
        src = int(comm.all_reduce(first, op="min"))
        if src == comm.size:
            return None
        buf = torch.zeros(NOTE_BYTES, dtype=torch.uint8, device=device)
        if comm.rank == src:
            text = self.first.encode()[:NOTE_BYTES]
            buf[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        comm.broadcast(buf, src)
        return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach(cfg, model: torch.nn.Module, rank: int) -> Detector | None:
    """The detector ``train.detect_anomaly`` asks for, or None (``off``)."""
    return Detector(model, rank) if cfg.train.detect_anomaly == "first_module" else None


def report_skipped(writer, step: int, note: str) -> None:
    """``train.nonfinite = "skip"``: one line and a metrics record (rank 0; ``writer`` may be None)."""
    if writer is None:
        return
    print(f"shardlab: skipped step {step}: {note}", file=sys.stderr, flush=True)
    writer.write({"kind": "anomaly", "step": step, "message": note})
