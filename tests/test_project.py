"""Project-level rules: import direction between the parts, and docs generated from code."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "tracker": {"router", "publishers", "bench"},
    "router": {"publishers", "bench"},
    "publishers": {"router", "bench"},
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_go_one_way(part: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & FORBIDDEN[part])
        for path in (ROOT / part).rglob("*.py")
        if imported_packages(path) & FORBIDDEN[part]
    }
    assert offenders == {}


def test_settings_page_is_generated_from_the_settings_classes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.settings_doc", "--check", str(ROOT / "docs" / "settings.md")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_stale_settings_page_fails_the_check(tmp_path: Path) -> None:
    page = tmp_path / "settings.md"
    page.write_text("# Settings\n")
    result = subprocess.run(
        [sys.executable, "-m", "bench.settings_doc", "--check", str(page)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 1
    assert "run scripts/settings-table" in result.stdout


PARTS = ("tracker", "router", "publishers", "bench")


def module_name(root: Path, path: Path) -> str:
    """``bench/plots.py`` -> ``bench.plots``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, parts: Sequence[str] = PARTS) -> dict[str, set[str]]:
    """Every module of ``parts`` under ``root`` -> the modules of ``parts`` it imports.

    Every import statement counts, wherever it stands: at module level, inside a function,
    under ``if TYPE_CHECKING:``. ``from pkg import mod`` names the module ``pkg.mod`` when
    that is a module of ours, else ``pkg``; ``import a.b.c`` names the longest of ``a.b.c``,
    ``a.b``, ``a`` that is one. Relative imports are resolved against the importing package.
    """
    files = {module_name(root, p): p for part in parts for p in sorted((root / part).rglob("*.py"))}

    def ours(dotted: str) -> str | None:
        while dotted and dotted not in files:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *filter(None, [node.module])])
                targets += [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
        graph[name] = {t for t in map(ours, targets) if t is not None and t != name}
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in order:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], order[successor])
        if low[node] == order[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def describe_cycles(graph: Mapping[str, set[str]], cycles: list[list[str]]) -> str:
    """Each cycle's modules with the imports that tie them, one module per line."""
    lines = []
    for component in cycles:
        lines.append("cycle: " + ", ".join(component))
        lines += [
            f"    {name} -> {', '.join(sorted(graph[name] & set(component)))}" for name in component
        ]
    return "\n".join(lines)


def test_the_import_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    files = {
        "bench/__init__.py": "",
        "bench/a.py": "import typing\nif typing.TYPE_CHECKING:\n    from bench.b import B\n",
        "bench/b.py": "def f():\n    from bench import c\n",
        "bench/c.py": "from . import a\nimport bench.d.e\n",
        "bench/d/__init__.py": "",
        "bench/d/e.py": "from ..c import x\nimport os\n",
        "router/x.py": "from bench.a import y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("bench", "router"))
    assert graph == {
        "bench": set(),
        "bench.a": {"bench.b"},
        "bench.b": {"bench.c"},
        "bench.c": {"bench.a", "bench.d.e"},
        "bench.d": set(),
        "bench.d.e": {"bench.c"},
        "router.x": {"bench.a"},
    }
    assert import_cycles(graph) == [["bench.a", "bench.b", "bench.c", "bench.d.e"]]


def test_no_import_cycles_between_our_modules() -> None:
    graph = import_graph(ROOT)
    cycles = import_cycles(graph)
    assert not cycles, describe_cycles(graph, cycles)


# The parts and what each may import. The framework (settings, the command, logs, HTTP,
# lifecycle, errors) is the bottom; the core (codec, block keys, tokenizer, index) builds on
# it; the tracker service, the router and the publishers build on both; the benchmarks use
# everything. Other parts reach the tracker service only through its public entry points.
ALLOWED: Mapping[str, frozenset[str]] = {
    "tracker": frozenset(),
    "tracker.framework": frozenset(),
    "tracker.core": frozenset({"tracker.framework"}),
    "tracker.ingest": frozenset({"tracker.core", "tracker.framework"}),
    "router": frozenset({"tracker.core", "tracker.framework"}),
    "publishers": frozenset({"tracker.core", "tracker.framework"}),
    "bench": frozenset({"tracker.core", "tracker.framework", "router", "publishers"}),
}
SERVICE_ENTRIES = frozenset({"tracker.ingest.embedded", "tracker.ingest.config"})


def part_of(module: str) -> str:
    """``tracker.core.index`` -> ``tracker.core``; ``router.baselines.seed`` -> ``router``."""
    head, _, rest = module.partition(".")
    sub = rest.partition(".")[0]
    return f"{head}.{sub}" if head == "tracker" and f"{head}.{sub}" in ALLOWED else head


def test_parts_import_only_towards_the_core() -> None:
    graph = import_graph(ROOT)
    offenders = {
        module: sorted(
            target
            for target in targets
            if part_of(target) != part_of(module)
            and part_of(target) not in ALLOWED[part_of(module)]
            and target not in SERVICE_ENTRIES
        )
        for module, targets in graph.items()
    }
    assert {module: bad for module, bad in offenders.items() if bad} == {}
    assert graph.keys() >= SERVICE_ENTRIES
    assert {part_of(module) for module in graph} == set(ALLOWED)


# router/ follows the request: the front ends (http/, the proxy; epp/, the endpoint picker)
# over the decision core (decide/), which reads the shared state (shared/) and the replicas
# (fleet/). Inner folders never import an outer one, and nothing but a front end serves.
ROUTER_LAYERS: Mapping[str, frozenset[str]] = {
    "router.shared": frozenset(),
    "router.fleet": frozenset({"router.shared"}),
    "router.decide": frozenset({"router.shared", "router.fleet", "router.baselines"}),
    "router.baselines": frozenset({"router.shared", "router.fleet", "router.decide"}),
}
ROUTER_FOLDERS = frozenset({*ROUTER_LAYERS, "router.http", "router.epp"})
ROUTER_COMMON = frozenset({"router.config", "router.errors", "router.metrics"})
SERVING = frozenset({"starlette", "uvicorn", "anyio", "grpc", "grpc_health"})


def router_folder(module: str) -> str | None:
    """``router.decide.policy`` -> ``router.decide``; None outside router/'s folders."""
    folder = ".".join(module.split(".")[:2])
    return folder if folder in ROUTER_FOLDERS else None


def test_router_folders_import_towards_the_shared_state_only() -> None:
    graph = import_graph(ROOT)
    offenders = {
        module: sorted(
            target
            for target in targets
            if target.startswith("router.")
            and (folder := router_folder(target)) != router_folder(module)
            and (folder is None or folder not in ROUTER_LAYERS[router_folder(module) or ""])
            and target not in ROUTER_COMMON
        )
        for module, targets in graph.items()
        if router_folder(module) in ROUTER_LAYERS
    }
    assert {module: bad for module, bad in offenders.items() if bad} == {}


def test_only_the_front_ends_serve() -> None:
    inner = [
        path for layer in ROUTER_LAYERS for path in (ROOT / layer.replace(".", "/")).rglob("*.py")
    ]
    assert len(inner) > 20
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & SERVING)
        for path in inner
        if imported_packages(path) & SERVING
    }
    assert offenders == {}


# A class lives in one file: a large class is cut by composition, never by an inheritance
# chain across modules. Only these bases are made to be extended elsewhere.
EXTENSION_POINTS = frozenset(
    {
        "Settings",  # tracker.framework.settings: every command's settings
        "LogSettings",
        "ServiceSettings",
        "KVRouterError",  # tracker.framework.errors: each part's error tree
        "EngineShape",  # publishers.config: the engine's size and speed, which configs extend
        "Baseline",  # router.baselines.baseline: the benchmark's policies
        "Hooks",  # bench.harness: what a benchmark run reports to
    }
)


def test_no_class_extends_a_class_of_another_module_but_the_extension_points() -> None:
    defined: dict[str, set[str]] = {}
    trees = {}
    for part in PARTS:
        for path in (ROOT / part).rglob("*.py"):
            trees[path] = tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    defined.setdefault(node.name, set()).add(str(path))
    offenders = []
    for path, tree in trees.items():
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                elsewhere = name in defined and str(path) not in defined[name]
                if elsewhere and name not in EXTENSION_POINTS:
                    offenders.append(f"{path.relative_to(ROOT)}: {node.name}({name})")
    assert offenders == []
