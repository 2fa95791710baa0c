"""Single-process multi-device ``DataParallel`` (the old ``torch.nn.DataParallel``), for comparison.

One Python process drives every device: each forward *scatters* the batch along dim 0,
*replicates* the parameters to every device (a differentiable copy, so their gradients are
summed back into the one set of parameters during backward), runs the replicas in threads and
*gathers* the outputs on ``output_device``. It needs no process group, but it copies the
parameters every step, the threads contend for Python's GIL, and the output device does the
gather and the loss: why DDP (one process per device) replaced it.

On a CPU-only machine ``device_ids=["cpu", "cpu"]`` replicates across two "cpu devices" (the
same memory): the mechanics and the parity are real, the speed-up is not.
"""
from __future__ import annotations

import threading

import torch
from torch import nn
from torch.func import functional_call


class DataParallel(nn.Module):
    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0):
        super().__init__()
        self.module, self.dim = module, dim
        if device_ids is None:
            n = torch.cuda.device_count()
            device_ids = [f"cuda:{i}" for i in range(n)] if n else ["cpu"]
        self.devices = [torch.device(d if not isinstance(d, int) else f"cuda:{d}") for d in device_ids]
        self.output_device = torch.device(output_device) if output_device is not None else self.devices[0]

    def forward(self, *inputs):
        chunks = [x.chunk(len(self.devices), self.dim) if torch.is_tensor(x) else [x] * len(self.devices)
                  for x in inputs]
        n = min(len(c) for c in chunks)  # a batch smaller than the device count uses fewer devices
        args = [[c[i].to(self.devices[i]) if torch.is_tensor(c[i]) else c[i] for c in chunks] for i in range(n)]
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        outputs: list = [None] * n
        grad, errors = torch.is_grad_enabled(), []

        def replica(i):
            try:
                with torch.set_grad_enabled(grad):
                    dev = self.devices[i]
                    state = {k: v.to(dev) for k, v in {**params, **buffers}.items()}  # differentiable copy
                    outputs[i] = functional_call(self.module, state, tuple(args[i]))
            except BaseException as e:  # re-raised in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=replica, args=(i,)) for i in range(1, n)]
        for t in threads:
            t.start()
        replica(0)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return self.gather(outputs)

    def gather(self, outputs):
        """Concatenate along ``dim``; scalars (per-replica losses) are stacked into a vector."""
        outs = [o.to(self.output_device) for o in outputs]
        return torch.stack(outs) if outs[0].dim() == 0 else torch.cat(outs, self.dim)
