"""The layers of docs/ARCHITECTURE.md, checked on the source: which module may import which, and no import cycle.

The layer map is read from ARCHITECTURE.md's table (its one home), and the imports from the code with ``ast``: every
import statement, also those inside functions, so a new module that breaks a rule fails here before anyone has to
notice it in review. A rank's imports are also checked on a real interpreter, since importing a module runs its
packages' ``__init__`` first.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("parallel_runtime", "parallel_nodes")
COMFYUI_MODULES = {"comfy", "comfy_api", "comfy_execution", "server", "folder_paths", "nodes", "execution"}


def layer_map() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """ARCHITECTURE.md's layer table: the modules of each layer (a package's modules inherit its layer unless named)
    and the layers each may import."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text.split("| layer | modules | may import |", 1)[1].split("\n\n", 1)[0]
    layers, allowed = {}, {}
    for row in table.strip().splitlines()[1:]:  # the header's last cell, its |---| line, then a row per layer
        if not row.startswith("| ") or row.startswith("|---"):
            continue
        layer, modules, may_import = (cell.strip() for cell in row.strip("|").split("|")[:3])
        layers[layer] = set(re.findall(r"`([\w.]+)`", modules))
        allowed[layer] = {name.strip() for name in may_import.split(",")}
    return layers, allowed


LAYERS, ALLOWED = layer_map()


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str:
    """The layer of a module: that of the longest name in the map it is or lies below."""
    named = [name for names in LAYERS.values() for name in names if module == name or module.startswith(name + ".")]
    assert named, f"{module} is in no layer of docs/ARCHITECTURE.md's table: add it there"
    best = max(named, key=len)
    return next(layer for layer, names in LAYERS.items() if best in names)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _statements(tree: ast.AST, *, in_functions: bool, for_type_checkers: bool) -> list[ast.Import | ast.ImportFrom]:
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif not in_functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif not for_type_checkers and _type_checking(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return found


def imports(
    module: str, path: Path, known: dict[str, Path], *, in_functions: bool = True, for_type_checkers: bool = True
) -> set[str]:
    """The modules of the pack ``module`` imports (relative imports resolved): ``from P import x`` names ``P.x`` when
    that is a module, else ``P``. By default every import statement; ``in_functions=False`` and
    ``for_type_checkers=False`` leave out those inside functions and those under ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in _statements(tree, in_functions=in_functions, for_type_checkers=for_type_checkers):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
            continue
        if node.level:
            base = package.split(".")
            prefix = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            prefix = node.module
        names |= {f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names}
    return {target for name in names if (target := pack_target(name, known)) is not None} - {module}


def absolute_imports(path: Path) -> set[str]:
    """Every module name ``path`` imports absolutely (the pack's and third parties')."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in _statements(tree, in_functions=True, for_type_checkers=True):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif not node.level and node.module:
            found.add(node.module)
    return found


def pack_target(name: str, known: dict[str, Path]) -> str | None:
    """The pack's module an imported name refers to (``parallel_runtime.wire.Sampling``: ``parallel_runtime.wire``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def ancestors(module: str, known: dict[str, Path]) -> list[str]:
    """The packages whose ``__init__`` runs before ``module`` does (``a.b.c``: ``a``, ``a.b``)."""
    parts = module.split(".")
    return [name for i in range(1, len(parts)) if (name := ".".join(parts[:i])) in known]


def layer_breaks(known: dict[str, Path]) -> list[str]:
    broken = []
    for module, path in sorted(known.items()):
        layer = layer_of(module)
        for target in sorted(imports(module, path, known)):
            if layer_of(target) not in ALLOWED[layer]:
                broken.append(f"{module} ({layer}) imports {target} ({layer_of(target)})")
        # Importing a module runs its packages first: what they import at import time, this module imports too.
        for package in ancestors(module, known):
            for target in sorted(imports(package, known[package], known, in_functions=False, for_type_checkers=False)):
                if layer_of(target) not in ALLOWED[layer]:
                    broken.append(f"{module} ({layer}) imports {target} ({layer_of(target)}) through {package}")
        if layer != "nodes":
            comfyui = sorted(name for name in absolute_imports(path) if name.split(".")[0] in COMFYUI_MODULES)
            broken += [f"{module} imports ComfyUI's {name}: only parallel_nodes may" for name in comfyui]
    return broken


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk of ``graph`` meets (each as the modules around it, the first one repeated)."""
    visiting, done, found = set(), set(), []

    def visit(module: str, trail: list[str]) -> None:
        if module in done:
            return
        if module in visiting:
            found.append(trail[trail.index(module) :] + [module])
            return
        visiting.add(module)
        for target in sorted(graph.get(module, ())):
            visit(target, trail + [module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Who imports whom, by any import statement (inside functions too): a circle through a lazy import is still one
    concept depending on itself. Imports for type checkers only are left out: they never run."""
    return {module: imports(module, path, known, for_type_checkers=False) for module, path in known.items()}


def test_the_layer_map_names_real_modules():
    """The table in ARCHITECTURE.md names modules that exist, every layer it allows exists, and nothing is left out."""
    known = modules()
    assert set(LAYERS) == {"nodes", "client", "worker", "shared"}
    assert all(allowed <= set(LAYERS) for allowed in ALLOWED.values())
    named = {name for names in LAYERS.values() for name in names}
    assert sorted(name for name in named if name not in known) == []
    for module in known:
        layer_of(module)


def test_every_module_keeps_to_its_layer():
    assert layer_breaks(modules()) == []


def test_no_import_cycle():
    assert cycles(import_graph(modules())) == []


def test_a_rank_imports_nothing_client_side():
    """A rank's interpreter, having imported every worker module (as ``python -m parallel_runtime.worker`` and its ops
    do), holds no module of the client side or the nodes: only the worker's and shared ones, and its packages."""
    script = (
        "import importlib, json, pkgutil, sys\n"
        "import parallel_runtime.worker as worker\n"
        "for info in pkgutil.iter_modules(worker.__path__):\n"
        "    if info.name != '__main__':  # it would start a rank\n"
        "        importlib.import_module(f'parallel_runtime.worker.{info.name}')\n"
        "names = [m for m in sys.modules if m.split('.')[0] in ('parallel_runtime', 'parallel_nodes')]\n"
        "print(json.dumps(sorted(names)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "parallel_runtime.worker.stages" in loaded  # the check ran on a real rank's modules
    # The package parallel_runtime runs on every rank; what it imports at import time keeps to the worker's layers
    # (test_every_module_keeps_to_its_layer checks a module's packages), and its client names stay unimported.
    packages = ancestors("parallel_runtime.worker", modules())
    assert sorted(m for m in loaded if m not in packages and layer_of(m) not in ALLOWED["worker"]) == []


def test_the_checks_see_a_broken_rule(tmp_path):
    """The rules above can fail: a worker module importing the client inside a function, and a package whose
    ``__init__`` imports the client, are reported; so is a circle closed by an import inside a function."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ..client import Backend\n")
    known = {**modules(), "parallel_runtime.worker.bad": bad}
    assert "parallel_runtime.worker.bad (worker) imports parallel_runtime.client (client)" in layer_breaks(known)

    package = tmp_path / "__init__.py"
    package.write_text("from ...client import Backend\n")
    leaf = tmp_path / "leaf.py"
    leaf.write_text("")
    known = {**modules(), "parallel_runtime.worker.pkg": package, "parallel_runtime.worker.pkg.leaf": leaf}
    assert any(b.endswith("through parallel_runtime.worker.pkg") for b in layer_breaks(known))

    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("from . import second\n")
    second.write_text("def f():\n    from .first import x\n")
    known = {**modules(), "parallel_runtime.worker.first": first, "parallel_runtime.worker.second": second}
    graph = import_graph(known)
    assert ["parallel_runtime.worker.first", "parallel_runtime.worker.second", "parallel_runtime.worker.first"] in (
        cycles(graph)
    )
