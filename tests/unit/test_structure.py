"""The package's structure rules, checked on the source: no module imports its own importer (no
cycle among module-level imports), no module outside ``shardlab/models/`` names an
architecture (they ask the ModelSpec), and config/ imports nothing above it."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import shardlab

ROOT = Path(shardlab.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path, everywhere: bool = False) -> set[str]:
    """shardlab modules imported at module level (``everywhere``: inside functions too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    for node in (ast.walk(tree) if everywhere else tree.body):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("shardlab")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("shardlab"):
                subs = {f"{mod}.{a.name}" for a in node.names}  # "from . import x" imports module x
                out |= subs
                if not everywhere or any(not _is_module(x) for x in subs):
                    out.add(mod)  # a name from the package itself: its __init__
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def test_no_import_cycles(everywhere: bool = False):
    """No cycle among module-level imports (``everywhere``: function-level ones too)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {m: {d for d in _top_level_imports(p, everywhere) if d in files and d != m} for m, p in files.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_import_cycles_counting_function_level_imports():
    """Also the imports inside functions (174 of 355 edges once): a lazy import only hides a
    cycle until the function runs, and the layers (docs/architecture.md) forbid it as much.
    (A package's ``__init__`` importing its children is not counted as their import of it.)"""
    test_no_import_cycles(everywhere=True)


def test_cycle_detector_can_fail(tmp_path, monkeypatch):
    """The detector is real: two modules importing each other are reported."""
    pkg = tmp_path / "shardlab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("from . import a\nx = 1\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("def f():\n    from .c import g\n")  # a cycle through a function
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    for everywhere, names in ((False, ("shardlab.a", "shardlab.b")), (True, ("shardlab.a", "shardlab.b"))):
        try:
            test_no_import_cycles(everywhere)
        except AssertionError as e:
            assert all(n in str(e) for n in names), e
        else:
            raise AssertionError("a two-module cycle was not detected")
    (pkg / "b.py").write_text("x = 1\n")
    test_no_import_cycles()  # c -> d -> c only through a function: module level passes
    try:
        test_no_import_cycles(everywhere=True)
    except AssertionError as e:
        assert "shardlab.c" in str(e) and "shardlab.d" in str(e)
    else:
        raise AssertionError("a cycle through a function-level import was not detected")


BELOW_CONFIG = ("shardlab.config", "shardlab.errors", "shardlab.checkpoint", "shardlab.distributed")


def test_config_imports_nothing_above_it():
    """config/ (layer 3, docs/architecture.md) imports only itself and the layers under it, not even
    inside a function: parallel/, models/ and train/ register their checks with it instead."""
    found = [f"{p.relative_to(ROOT)}: {m}" for p in (ROOT / "config").rglob("*.py")
             for m in sorted(_top_level_imports(p, everywhere=True))
             if not any(m == b or m.startswith(b + ".") for b in BELOW_CONFIG)]
    assert (ROOT / "config" / "validation.py").is_file() and not found, "config imports above it:\n" + "\n".join(found)


def test_config_layer_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "shardlab" / "config").mkdir(parents=True)
    (tmp_path / "shardlab" / "config" / "validation.py").write_text("def f():\n    from ..parallel import tensor\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "shardlab")
    with pytest.raises(AssertionError, match="shardlab.parallel"):
        test_config_imports_nothing_above_it()


RANK_PACKAGES = ("train", "checkpoint", "parallel", "models", "distributed")


def test_ranks_never_import_the_launcher():
    """What runs in a rank (train/, checkpoint/, parallel/, models/, distributed/) never imports
    shardlab.launch*, inside functions neither: the parent resolves the run plan and hands it over
    in the RankContext (docs/architecture.md, "The run plan")."""
    found = [f"{p.relative_to(ROOT)}: {m}" for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] in RANK_PACKAGES
             for m in sorted(_top_level_imports(p, everywhere=True)) if m.startswith("shardlab.launch")]
    assert not found, "a rank's module imports the launcher:\n" + "\n".join(found)


def test_launcher_import_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "shardlab" / "checkpoint").mkdir(parents=True)
    (tmp_path / "shardlab" / "checkpoint" / "x.py").write_text("def f():\n    from ..launch import test_env\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "shardlab")
    try:
        test_ranks_never_import_the_launcher()
    except AssertionError as e:
        assert "checkpoint/x.py: shardlab.launch" in str(e)
    else:
        raise AssertionError("a function-level import of the launcher was not reported")


ARCH = re.compile(r"\b(llama|gpt-?2|cnn)\b", re.IGNORECASE)
WORD = re.compile(r"""^[rbuf]*["'][\w.:-]+["']$""")  # a string that is one word: an identifier or key
ALLOWED = {("config/schema.py", '"llama"')}  # the default of model.arch


def test_only_models_name_an_architecture():
    """Code outside shardlab/models/ never names an architecture: identifiers and one-word strings
    (keys, names compared against), not docstrings, comments or help texts."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "models":
            continue
        src = path.read_text()
        tree = ast.parse(src)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        doc_lines = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and id(n) in docstrings:
                doc_lines |= set(range(n.lineno, n.end_lineno + 1))
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            code_string = tok.type == tokenize.STRING and WORD.match(tok.string)  # "llama", not prose
            if (tok.type == tokenize.NAME or code_string) and tok.start[0] not in doc_lines:
                if (str(rel), tok.string) in ALLOWED:
                    continue
                if ARCH.search(tok.string):
                    found.append(f"{rel}:{tok.start[0]}: {tok.string[:60]}")
    assert not found, "architecture named outside shardlab/models/:\n" + "\n".join(found)


def test_architecture_check_can_fail(tmp_path, monkeypatch):
    pkg = tmp_path / "shardlab"
    (pkg / "parallel").mkdir(parents=True)
    (pkg / "parallel" / "x.py").write_text('"""Works for llama and gpt2 alike."""\nif arch == "gpt2":\n    pass\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    try:
        test_only_models_name_an_architecture()
    except AssertionError as e:
        assert "x.py:2" in str(e) and "x.py:1" not in str(e)
    else:
        raise AssertionError("a module comparing against an architecture name was not reported")


def _readme_layout() -> set[str]:
    readme = (ROOT.parent / "README.md").read_text()
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    return {line.split()[0] for line in block.splitlines() if line.split() and line.split()[0].endswith(".py")}


def test_readme_layout_lists_every_module():
    """The README's layout names every module of shardlab/ (one line each) and none that is gone."""
    have = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
            if p.name != "__init__.py" or p.read_text().strip()}
    listed = _readme_layout()
    assert listed == have, f"missing from README: {sorted(have - listed)}; gone: {sorted(listed - have)}"
    assert len(listed) > 100  # the parser found the block (a vacuous pass would list nothing)


COMM_CALL = re.compile(r"\bdist\.(all_reduce|all_gather\w*|broadcast\w*|reduce_scatter\w*|all_to_all\w*|barrier|"
                       r"monitored_barrier|new_group|group\.WORLD|send|recv|isend|irecv|batch_isend_irecv|gather|"
                       r"scatter)\b")
COMM_EXCEPTIONS = {  # module -> why it may call torch.distributed itself
    "launch.py": "starts the ranks and creates the process group",
    "launch_ray.py": "starts the ranks and creates the process group",
    "launch_replicas.py": "starts the replica groups and their process groups",
    "commands/bench_comm.py": "times the backend's collectives themselves",
    "commands/doctor_cmd.py": "probes the backend itself",
    "parallel/ddp.py": "torch's DistributedDataParallel API takes a process_group (the engine passes its Mesh's Comm)",
}


def test_communication_only_through_the_mesh():
    """Outside the communication layer (distributed/) every collective goes through a Mesh's
    Comm: no default group, no group created elsewhere, every byte in the rank's one ledger."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("distributed/") or rel in COMM_EXCEPTIONS:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COMM_CALL.search(line.split("#")[0]):
                found.append(f"{rel}:{i}: {line.strip()[:80]}")
    assert not found, "torch.distributed called outside the Mesh:\n" + "\n".join(found)
    assert COMM_CALL.search("x = dist.new_group([0, 1])") and not COMM_CALL.search("dist.get_rank()")
