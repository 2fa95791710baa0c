"""DualPipe and DualPipeV (DeepSeek-V3) as compute orders per rank (schedule-as-data form;
docs/pipeline.md, "DualPipe and DualPipeV", with the stage placement of both).

Two chunks per rank fill each other's bubbles. DualPipeV: 2p stages, rank r holds stages r and
2p-1-r (one parameter copy, a V; m >= 2p). DualPipe: p stages, rank r holds stage r and a copy of
stage p-1-r, half the micro-batches entering at each end (stage id p+k runs stage k's parameters
on rank p-1-k; p and m even, m >= 2p). The order per rank follows DeepSeek's reference, eight steps
(nF0, nF0F1, nB1W1F1, nF0B1F1B0, nB1F1B0, nB1B0, nWB0, nW), its "F&B" pairs listed as F then B
(pairs.py runs them as two lanes) and its zero-bubble backwards (a ``zb`` backward defers its W to
a FIFO queue popped by the next "W" step). Bubble per rank: (PP/2-1)(F&B+B-3W), with F&B = F + B
serialised (:func:`dual_idle`).
"""
from __future__ import annotations


def _rank_order(n_half: int, h: int, n: int) -> list[tuple[str, int, bool]]:
    """DeepSeek's eight steps for the rank at distance ``h`` from its end of the pipe
    (``n_half`` ranks per half, ``n`` micro-batches per chunk): [(kind, chunk, zb)], kind in
    F, B (B with zb defers its W), W (the oldest deferred W)."""
    ops: list[tuple[str, int, bool]] = []
    F = lambda c: ops.append(("F", c, False))  # noqa: E731
    B = lambda c, zb=False: ops.append(("B", c, zb))  # noqa: E731
    W = lambda: ops.append(("W", -1, False))  # noqa: E731
    for _ in range((n_half - h - 1) * 2):           # 1: nF0
        F(0)
    for _ in range(h + 1):                           # 2: nF0F1
        F(0)
        F(1)
    for _ in range(n_half - h - 1):                  # 3: nB1W1F1 (zero bubble)
        B(1, True)
        W()
        F(1)
    for _ in range(n - 2 * n_half + h + 1):          # 4: nF0B1F1B0 (main)
        F(0)
        B(1)
        F(1)
        B(0)
    for _ in range(n_half - h - 1):                  # 5: nB1F1B0
        B(1)
        F(1)
        B(0)
    zb, steps = False, h + 1                          # 6: nB1B0, second half zero bubble
    for i in range(steps):
        if i == steps // 2 and h % 2 == 1:
            zb = True
        B(1, zb)
        if i == steps // 2 and h % 2 == 0:
            zb = True
        B(0, zb)
    for _ in range(n_half - h - 1):                  # 7: nWB0
        W()
        B(0, True)
    for _ in range(h + 1):                           # 8: nW
        W()
    return ops


def _expand(ops, chunk_stage: dict, chunk_mbs: dict) -> list[tuple]:
    """(kind, chunk, zb) -> (kind, mb, stage) actions: micro-batches in order per chunk; a plain
    backward becomes B then W; a zb backward's W waits in a FIFO for the next W step."""
    nf, nb, queue, out = {0: 0, 1: 0}, {0: 0, 1: 0}, [], []
    for kind, c, zb in ops:
        if kind == "F":
            out.append(("F", chunk_mbs[c][nf[c]], chunk_stage[c]))
            nf[c] += 1
        elif kind == "B":
            act = (chunk_mbs[c][nb[c]], chunk_stage[c])
            nb[c] += 1
            out.append(("B",) + act)
            if zb:
                queue.append(act)
            else:
                out.append(("W",) + act)
        else:
            out.append(("W",) + queue.pop(0))
    assert not queue and all(nf[c] == nb[c] == len(chunk_mbs[c]) for c in (0, 1)), "dualpipe order"
    return out


def dualpipev(p: int, m: int) -> list[list[tuple]]:
    """Compute order per rank; rank r: chunk 0 = stage r, chunk 1 = stage 2p-1-r."""
    return [_expand(_rank_order(p, r, m), {0: r, 1: 2 * p - 1 - r},
                    {0: range(m), 1: range(m)}) for r in range(p)]


def dualpipe(p: int, m: int) -> list[list[tuple]]:
    """Compute order per rank; rank r < p/2: chunk 0 = stage r of direction 0 (micro-batches
    0..m/2-1), chunk 1 = stage id 2p-1-r of direction 1; ranks r >= p/2 mirror that."""
    half, out = m // 2, []
    down, up = range(half), range(half, m)
    for r in range(p):
        h = min(r, p - 1 - r)
        mine = {0: r, 1: 2 * p - 1 - r}  # direction 0 stage, direction 1 stage id
        if r < p // 2:
            cs, cm = mine, {0: down, 1: up}
        else:
            cs, cm = {0: mine[1], 1: mine[0]}, {0: up, 1: down}
        out.append(_expand(_rank_order(p // 2, h, half), cs, cm))
    return out


def dual_idle(name: str, p: int, f: float, b: float, w: float) -> float:
    """Idle time per rank (f, b, w: a rank's whole share; b = input gradient only).
    DualPipe: chunk = one stage of p, (p/2-1)(F&B + B_full - 3W) with F&B = f + b + w and
    B_full = b + w. DualPipeV: 2p chunks of half a share, (2p/2-1)(...) in half units."""
    fb, bfull = f + b + w, b + w
    if name == "dualpipe":
        return (p / 2 - 1) * max(fb + bfull - 3 * w, 0.0)
    return (p - 1) * max(fb + bfull - 3 * w, 0.0) / 2
