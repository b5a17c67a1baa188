"""The import rules of docs/architecture.md, checked on the source: every ``import sptool.X`` and
``from sptool.X import …`` (at module level, inside functions and under ``TYPE_CHECKING``) is an
arrow from one module to another. A *package* is a subpackage of ``sptool`` (``run``, ``train``,
…) or a top-level module (``records``, ``verify``, …). Each package sits on a declared layer;
an arrow may stay on its layer or go down, never up, and the packages' arrows form no circle
(nor do the modules' inside a package).

``python cli_tests/test_layering.py`` prints the counts (modules, packages, arrows, circles,
arrows back up) and every offending arrow.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "sptool"

# Layer of each package, lowest first (docs/architecture.md, "Layers").
LAYERS: list[tuple[str, ...]] = [
    # 0 core: records, JSONL, atomic files, the stage contract, registries, process pools, fault points
    ("core",),
    # 1 support: outbound HTTP, reasoning-gym sets, reward formulas
    ("net", "gym", "rewards"),
    # 2 models and prompts
    ("models", "prompts"),
    # 3 the stages the command line exposes (one module or package each)
    ("stages",),
    # 4 typed settings and their limits (they name the objectives and backends), training groups,
    # training, processes
    ("settings", "filter", "train", "distributed", "serve"),
    # 5 the executor (knows no recipe)
    ("run", "export"),
    # 6 the papers' loops
    ("recipes",),
    # 7 the command line
    ("cli", "__main__", "__init__"),
]
LAYER = {package: index for index, packages in enumerate(LAYERS) for package in packages}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_graph() -> dict[str, set[str]]:
    """Module -> the sptool modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        graph[name]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".")
                    if path.name != "__init__.py":
                        base = base[:-1]
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module]
                # ``from sptool.run import faults`` names a module
                targets += [f"{module}.{alias.name}" for alias in node.names
                            if f"{module}.{alias.name}" in modules]
            for target in targets:
                if target == "sptool" or not target.startswith("sptool."):
                    continue
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for module, targets in graph.items():
        packages[package_of(module)]
        for target in targets:
            if package_of(target) != package_of(module):
                packages[package_of(module)].add(package_of(target))
    return packages


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def picture() -> dict:
    graph = import_graph()
    packages = package_graph(graph)
    arrows = [(a, b) for a, targets in packages.items() for b in targets]
    unplaced = sorted(p for p in packages if p not in LAYER)
    upward = sorted((a, b) for a, b in arrows if a in LAYER and b in LAYER and LAYER[b] > LAYER[a])
    inner = {m: {t for t in targets if package_of(t) == package_of(m)} for m, targets in graph.items()}
    return {
        "modules": len(graph),
        "packages": len(packages),
        "arrows": len(arrows),
        "module_arrows": sum(len(t) for t in graph.values()),
        "package_circles": circles(packages),
        "module_circles": circles(inner),
        "upward": upward,
        "unplaced": unplaced,
        "graph": graph,
    }


def offending_imports(graph: dict[str, set[str]], pairs: list[tuple[str, str]]) -> list[str]:
    wanted = set(pairs)
    return sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                  if (package_of(m), package_of(t)) in wanted)


def test_every_package_has_a_layer():
    assert picture()["unplaced"] == []


def test_no_import_climbs_back_up():
    p = picture()
    assert offending_imports(p["graph"], p["upward"]) == []


def test_no_circle_between_packages():
    assert picture()["package_circles"] == []


def test_no_circle_between_modules_of_a_package():
    assert picture()["module_circles"] == []


def test_the_source_imports_modules_by_their_present_names():
    """No import in src/ names a module that moved (the arrows above would miss it): every
    ``sptool.X`` it imports exists under that name."""
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    stale = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [])
            stale += [f"{path.relative_to(SRC)}: {name}" for name in names
                      if name.startswith("sptool.") and name not in modules]
    assert stale == []


def test_moved_modules_import_under_their_old_names():
    """``import sptool.records`` (a name from before the re-layout) is the module at its new name,
    the same object, and says where it went; a submodule of a moved package too."""
    import subprocess

    code = ("import warnings, sys; warnings.simplefilter('always');\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import sptool.records, sptool.challenge.parsing, sptool.limits\n"
            "import sptool.core.records, sptool.stages.challenge.parsing, sptool.settings.limits\n"
            "assert sys.modules['sptool.records'] is sptool.core.records\n"
            "assert sys.modules['sptool.challenge.parsing'] is sptool.stages.challenge.parsing\n"
            "assert sys.modules['sptool.limits'] is sptool.settings.limits\n"
            "assert sptool.stages.challenge.parsing.__spec__.name == 'sptool.stages.challenge.parsing'\n"
            "print([str(w.message) for w in caught])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "sptool.records moved to sptool.core.records" in result.stdout
    assert "sptool.challenge.parsing moved to sptool.stages.challenge.parsing" in result.stdout


if __name__ == "__main__":
    p = picture()
    print(f"modules {p['modules']}, packages {p['packages']}, arrows between packages {p['arrows']} "
          f"(between modules {p['module_arrows']}), circles between packages {len(p['package_circles'])}, "
          f"circles between modules of a package {len(p['module_circles'])}, arrows back up {len(p['upward'])}")
    for circle in p["package_circles"]:
        print("package circle:", " <-> ".join(circle))
    for circle in p["module_circles"]:
        print("module circle:", " <-> ".join(circle))
    for line in offending_imports(p["graph"], p["upward"]):
        print("back up:", line)
    for package in p["unplaced"]:
        print("no layer:", package)
