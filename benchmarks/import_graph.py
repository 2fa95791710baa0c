"""shardlab's import graph from the source (not a speed benchmark: the structure's own figures,
docs/architecture.md): strongly connected groups of modules counting module-level imports and
also function-level ones, and a picture of the packages and their imports.

    python benchmarks/import_graph.py                       # this checkout
    python benchmarks/import_graph.py --rev b36421f --png docs/img/imports_before.png
"""
from __future__ import annotations

import argparse
import ast
import io
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [["cli"], ["api", "analysis"], ["launch"], ["train"], ["parallelize"], ["parallel"],
          ["config", "models"], ["checkpoint"], ["distributed"], ["errors"]]
"""Packages by layer, top to bottom (docs/architecture.md): an import should point down."""


def group(mod: str) -> str:
    parts = mod.split(".")
    top = parts[1] if len(parts) > 1 else "api"
    return {"config_checks": "config", "checks": "config", "deepspeed_config": "config",  # before shardlab/config/
            "commands": "cli",
            "launch_ray": "launch", "launch_replicas": "launch", "launch_report": "launch",
            "launch_restart": "launch"}.get(top, top)


def graph(src: Path, everywhere: bool) -> dict[str, set[str]]:
    pkg = src / "shardlab"
    files = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    out = {}
    for name, path in files.items():
        base = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps, tree = set(), ast.parse(path.read_text())
        for node in (ast.walk(tree) if everywhere else tree.body):
            if isinstance(node, ast.ImportFrom):
                mod = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                subs = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in files}
                deps |= subs | ({mod} if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        out[name] = {d for d in deps if d in files and d != name}
    return out


def sccs(g: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def draw(g: dict[str, set[str]], cycles: list[list[str]], title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pos = {p: ((i + 0.5) / len(row), 1 - k / (len(LAYERS) - 1)) for k, row in enumerate(LAYERS) for i, p in enumerate(row)}
    cycle_of = {m: k for k, c in enumerate(cycles) for m in c}
    edges = Counter()
    bad = Counter()
    for m, deps in g.items():
        for d in deps:
            a, b = group(m), group(d)
            if a != b:
                edges[a, b] += 1
                bad[a, b] += m in cycle_of and cycle_of.get(d) == cycle_of[m]
    fig, ax = plt.subplots(figsize=(8, 7))
    for (a, b), n in edges.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        up = y1 > y0
        color = "tab:red" if bad[a, b] else ("tab:orange" if up else "0.6")
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(
            arrowstyle="-|>", mutation_scale=12, color=color, lw=0.6 + 0.25 * n ** 0.5, shrinkA=14, shrinkB=14,
            connectionstyle="arc3,rad=0.12"))
    for p, (x, y) in pos.items():
        size = sum(1 for m in g if group(m) == p)
        ax.text(x, y, f"{p}\n{size} modules", ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round", fc="white", ec="0.3"))
    ax.set_axis_off()
    ax.set_title(f"{title}\ngrey: an import pointing down; orange: pointing up; red: part of an import cycle",
                 fontsize=9, pad=28)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="", help="a git revision to read instead of the working tree")
    ap.add_argument("--png", default="", help="draw the packages and their imports (function level) here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = ROOT
        if args.rev:
            data = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "shardlab"], capture_output=True,
                                  check=True).stdout
            tarfile.open(fileobj=io.BytesIO(data)).extractall(tmp, filter="data")
            src = Path(tmp)
        print("| imports counted | modules | edges | cycles (strongly connected groups) | modules in them |")
        print("|---|---|---|---|---|")
        for everywhere in (False, True):
            g = graph(src, everywhere)
            c = sccs(g)
            print(f"| {'module and function level' if everywhere else 'module level'} | {len(g)} | "
                  f"{sum(map(len, g.values()))} | {len(c)} | {sum(map(len, c))} |")
        for comp in c:
            print("  cycle:", ", ".join(comp))
        rank = {p: k for k, row in enumerate(LAYERS) for p in row}
        up = sorted({(group(m), group(d), m, d) for m, deps in g.items() for d in deps
                     if rank[group(d)] < rank[group(m)] or (rank[group(d)] == rank[group(m)] and group(d) != group(m))})
        for a, b, m, d in up:
            print(f"  up or sideways: {a} -> {b}: {m} -> {d}")
        lines = sum(len(p.read_text().splitlines()) for p in (src / "shardlab").rglob("*.py"))
        print(f"lines of shardlab/*.py: {lines:,}")
        if args.png:
            draw(g, c, f"shardlab {args.rev or 'working tree'}: imports between packages", args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
