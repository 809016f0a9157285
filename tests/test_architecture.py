"""The layers of docs/ARCHITECTURE.md, checked on the source: which module may import which, and no import cycle.

Read from the code with ``ast`` (every import statement, also those inside functions), so a new module that breaks a
rule fails here before anyone has to notice it in review.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Layer of each module of the pack (a package's modules inherit its layer unless named).
SHARED = {
    "parallel_runtime.errors",
    "parallel_runtime.serial",
    "parallel_runtime.strategy",
    "parallel_runtime.wire",
    "parallel_runtime.protocol",
    "parallel_runtime.arena",
    "parallel_runtime.sealed",
    "parallel_runtime.processes",
    "parallel_runtime.spec",
    "parallel_runtime.families",
    "parallel_runtime.rundir",
    "parallel_runtime.rendezvous",
    "parallel_runtime.internals",
    "parallel_runtime.samplers",
}
CLIENT = {
    "parallel_runtime",
    "parallel_runtime.client",
    "parallel_runtime.launcher",
    "parallel_runtime.jobs",
    "parallel_runtime.model_folders",
    "parallel_runtime.comfy_files",
    "parallel_runtime.cli",
    "parallel_runtime.watchdog",
    "parallel_runtime.machines",
}
LAYERS = {
    "shared": SHARED,
    "client": CLIENT,
    "worker": {"parallel_runtime.worker"},
    "testing": {"parallel_runtime.testing"},
    "nodes": {"parallel_nodes"},
}
# What each layer may import from the pack.
ALLOWED = {
    "shared": {"shared", "testing"},  # a family names its tiny model builder (imported when a test calls it)
    "worker": {"shared", "worker"},
    "client": {"shared", "client"},
    "testing": {"shared", "testing"},
    "nodes": {"shared", "client", "nodes"},
}
COMFYUI_MODULES = {"comfy", "comfy_api", "comfy_execution", "server", "folder_paths", "nodes", "execution"}


def modules() -> dict[str, Path]:
    found = {}
    for package in ("parallel_runtime", "parallel_nodes"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str:
    best = max(
        (name for names in LAYERS.values() for name in names if module == name or module.startswith(name + ".")),
        key=len,
    )
    return next(layer for layer, names in LAYERS.items() if best in names)


def imports(module: str, path: Path, top_level_only: bool = False) -> set[str]:
    """The absolute names ``module`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names.add(prefix)
            names |= {f"{prefix}.{alias.name}" for alias in node.names}
    return names


def pack_target(name: str, known: dict[str, Path]) -> str | None:
    """The pack's module an imported name refers to (``parallel_runtime.wire.Sampling``: ``parallel_runtime.wire``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_keeps_to_its_layer():
    known = modules()
    broken = []
    for module, path in sorted(known.items()):
        layer = layer_of(module)
        for name in imports(module, path):
            target = pack_target(name, known)
            if target is not None and layer_of(target) not in ALLOWED[layer]:
                broken.append(f"{module} ({layer}) imports {target} ({layer_of(target)})")
            if layer != "nodes" and name.split(".")[0] in COMFYUI_MODULES:
                broken.append(f"{module} imports ComfyUI's {name}: only parallel_nodes may")
    assert broken == []


def test_no_import_cycle():
    """At import time (module-level imports; an import inside a function is lazy by design)."""
    known = modules()
    graph = {
        m: {pack_target(n, known) for n in imports(m, p, top_level_only=True)} - {None, m} for m, p in known.items()
    }
    # A package imports its own submodules to re-export them; that edge is not a cycle.
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}
    visiting, done, cycles = set(), set(), []

    def visit(module: str, trail: list[str]) -> None:
        if module in done:
            return
        if module in visiting:
            cycles.append(trail[trail.index(module) :] + [module])
            return
        visiting.add(module)
        for target in sorted(graph.get(module, ())):
            visit(target, trail + [module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert cycles == []


def test_the_checks_see_a_broken_rule(tmp_path):
    """The rules above can fail: a worker module importing the client is reported."""
    path = tmp_path / "bad.py"
    path.write_text("from ..client import Backend\n")
    known = {**modules(), "parallel_runtime.worker.bad": path}
    targets = {pack_target(n, known) for n in imports("parallel_runtime.worker.bad", path)}
    assert "parallel_runtime.client" in targets
    assert layer_of("parallel_runtime.client") not in ALLOWED[layer_of("parallel_runtime.worker.bad")]
