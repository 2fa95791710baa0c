"""The README's design rules, one test each (the structural ones live in test_structure.py):

| rule (README, "Design rules") | test |
|---|---|
| no global process-group state: a Mesh is passed to whatever communicates | test_structure.py::test_communication_only_through_the_mesh |
| models know nothing of distribution | test_models_know_nothing_of_distribution (here) |
| no module outside models/ names an architecture | test_structure.py::test_only_models_name_an_architecture |
| parameters initialised from (seed, global name) | test_model.py::test_init_depends_only_on_seed_and_name |
| every collective is counted in the ledger | tests/distributed/test_collectives.py::test_ledger_own_algorithm_bytes_are_measured_on_the_wire (bytes against the wire), test_shared_comm.py (the shared transport's ledger equals the process group's) |
| environment variables are read only in cli.py and the launchers | test_environment_read_only_in_cli_and_launchers (here) |

Each check is shown to fail on a planted violation.
"""
import ast
from pathlib import Path

import shardlab
from tests.unit.test_structure import _is_module

ROOT = Path(shardlab.__file__).parent

MODELS_MAY_IMPORT = {
    # the pretrained loader materialises meta parameters from (seed, global name), a pure
    # function of names and shapes, with no process group (parallel/materialize.py)
    ("models/pretrained.py", "parallel.materialize"),
}
ENV_READERS = ("cli.py", "launch.py", "launch_ray.py", "launch_replicas.py", "launch_restart.py", "launch_report.py")


def _from_module(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from ... import`` names, relative levels resolved against ``package``."""
    base = package[:len(package) - node.level + 1] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.AST, package: list[str]) -> set[str]:
    """Every module a file imports, module level and inside functions ("shardlab." dropped)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(_from_module(node, package))
    return {m.removeprefix("shardlab.") for m in out}


def _distribution_imports(rel: str, src: str) -> list[str]:
    package = ["shardlab"] + list(Path(rel).parent.parts)
    bad = []
    for mod in sorted(_imports(ast.parse(src), package)):
        hit = mod.startswith(("torch.distributed", "distributed", "parallel", "launch", "train"))
        if hit and (rel, mod) not in MODELS_MAY_IMPORT:
            bad.append(f"{rel} imports {mod}")
    return bad


def test_models_know_nothing_of_distribution():
    """models/ imports neither torch.distributed nor shardlab's distributed/, parallel/, launch or
    train/ (function-level imports included): parallel plans are data in the ModelSpec."""
    found = []
    for path in (ROOT / "models").rglob("*.py"):
        found += _distribution_imports(str(path.relative_to(ROOT)), path.read_text())
    assert not found, "\n".join(found)
    planted = "def f():\n    from ...distributed.mesh import Mesh\n    import torch.distributed as dist\n"
    assert len(_distribution_imports("models/llama/x.py", planted)) == 2


def _env_reads(src: str) -> list[int]:
    """Lines that read the environment: os.environ, os.getenv, environ (imported from os)."""
    lines = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            lines.append(node.lineno)
    return lines


def test_environment_read_only_in_cli_and_launchers():
    found = []
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel in ENV_READERS:
            continue
        found += [f"{rel}:{n}" for n in _env_reads(path.read_text())]
    assert not found, "environment read outside cli.py and the launchers: " + ", ".join(found)
    assert _env_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert _env_reads("from os import getenv\nx = getenv('A')\n") == [2]


def _unresolved(rel: str, src: str) -> list[str]:
    """shardlab modules that ``rel`` imports (inside functions too) and that do not exist."""
    package = ["shardlab"] + list(Path(rel).parent.parts)
    return [f"{rel}:{node.lineno}: {mod}" for node in ast.walk(ast.parse(src))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("shardlab"))
            and not _is_module(mod := _from_module(node, package))]


def test_every_internal_import_resolves():
    """Every relative or shardlab import names a module that exists, function-level imports too
    (a lazy import of a moved module fails only when its line runs)."""
    found = []
    for path in ROOT.rglob("*.py"):
        found += _unresolved(str(path.relative_to(ROOT)), path.read_text())
    assert not found, "imports of modules that do not exist:\n" + "\n".join(found)
    assert _unresolved("config/schema.py", "def f():\n    from .models.spec import ffn_dim\n") == \
        ["config/schema.py:2: shardlab.config.models.spec"]


def test_every_tensor_reader_is_a_tensor_source():
    """checkpoint/reader.TensorSource is the one reader protocol: the sharded checkpoint's Reader,
    the Hugging Face and GGUF readers and the wrappers of models/pretrained.py all provide it."""
    from shardlab.checkpoint.reader import Reader, TensorSource
    from shardlab.models.gguf import GGUFTensors
    from shardlab.models.hf import HFReader
    from shardlab.models.pretrained import Layered, MergedLoRA
    members = ("keys", "has", "global_shape", "read", "close")
    for cls in (Reader, GGUFTensors, HFReader):
        assert all(callable(getattr(cls, m, None)) for m in members), cls.__name__

    class Source:
        def keys(self):
            return []

        has = global_shape = read = close = keys

    assert isinstance(Source(), TensorSource) and not isinstance(object(), TensorSource)
    for wrapper in (Layered(Source(), Source()), MergedLoRA(Source(), 1.0)):
        assert isinstance(wrapper, TensorSource), type(wrapper).__name__
