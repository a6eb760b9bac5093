"""The layers of specdec, read from its sources with ast: every `import` counts, also those inside functions
(a lazy import is still a dependency), except under `if TYPE_CHECKING:` (no dependency at run time).

A unit is a subpackage (`specdec.models`, `specdec.engine`, ...) or a module directly under `specdec`
(`specdec.api`, ...). Bottom to top, roughly: the tables of decoder families and of speculative methods ->
config, sampling, kernels -> models (with their K/V cache) ->
heads -> speculative -> engine (the package of the engine's parts: scheduler, verification, output text, stops,
prefix cache, memory plan) -> fan_out (n / best_of) -> api -> llm_args -> server, bench, training -> cli,
deploy (Ray Serve's application); parallel (tensor parallelism) sits on models; testing (helpers of the tests
and benchmarks) is imported by none of them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import specdec

ROOT = Path(specdec.__file__).parent

ABOVE_ENGINE = {"fan_out", "api", "server", "bench", "training", "cli", "llm_args"}
# unit -> the units it must never import
FORBIDDEN = {
    # the table of decoder families: under config, which reads it
    "architectures": {"config", "sampling", "kernels", "models", "heads", "speculative", "engine", *ABOVE_ENGINE},
    # the table of speculative methods: under config, which reads it (what it names above it, it names by string)
    "methods": {"architectures", "config", "sampling", "kernels", "models", "heads", "speculative", "engine",
                "parallel", "deploy", *ABOVE_ENGINE},
    "config": {"sampling", "models", "heads", "speculative", "engine", *ABOVE_ENGINE},
    # the native libraries and their loading: under everything but config (SPECDEC_HOME)
    "kernels": {"sampling", "models", "heads", "speculative", "engine", "parallel", "deploy", *ABOVE_ENGINE},
    "sampling": {"models", "heads", "speculative", "engine", *ABOVE_ENGINE},
    "models": {"speculative", "heads", "engine", *ABOVE_ENGINE},
    "heads": {"speculative", "engine", *ABOVE_ENGINE},
    "speculative": {"engine", *ABOVE_ENGINE},
    "engine": {*ABOVE_ENGINE, "deploy"},  # the engine's parts included: nothing in specdec/engine imports upward
    "fan_out": ABOVE_ENGINE - {"fan_out"},
    # tensor parallelism shards the models; the engine and the server will use it, never the other way
    "parallel": {"speculative", "heads", "engine", "deploy", *ABOVE_ENGINE},
    # the Ray Serve application sits on top of the server; nothing in the package imports it
    **{unit: {"deploy"} for unit in ("server", "api", "cli", "bench", "llm_args")},
}
# the modules directly under specdec: the entry points and the few primitives under everything
ROOT_MODULES = {"__init__", "__main__", "architectures", "methods", "config", "sampling", "fan_out", "api", "llm_args",
                "cli", "deploy"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit(module: str) -> str:
    """specdec.models.llama -> models; specdec.engine -> engine; specdec -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path: Path) -> set[str]:
    """The specdec modules `path` imports (absolute or relative), TYPE_CHECKING blocks left out."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            else:  # `from specdec.engine import verification` imports the module specdec.engine.verification
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                found.update(m for m in submodules if is_module(m))
                if not all(map(is_module, submodules)):
                    found.add(node.module or "")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m == "specdec" or m.startswith("specdec.")}


def unit_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        source = unit(module_name(path))
        graph.setdefault(source, set()).update(u for u in map(unit, imported_modules(path)) if u != source)
    return graph


def offending_imports(source: str, forbidden: set[str]) -> list[str]:
    """`path: module` for every import from unit `source` of a unit in `forbidden`."""
    return [f"{path.relative_to(ROOT.parent)}: {m}" for path in sorted(ROOT.rglob("*.py"))
            if unit(module_name(path)) == source for m in sorted(imported_modules(path)) if unit(m) in forbidden]


def test_the_walk_sees_the_package():
    graph = unit_graph()
    assert {"models", "heads", "speculative", "engine", "fan_out", "api", "server", "cli", "training"} <= set(graph)
    assert {"engine", "fan_out"} <= graph["api"] and "fan_out" in graph["server"]
    assert "speculative" in graph["engine"] and "engine" in graph["training"]  # imports inside functions count too


@pytest.mark.parametrize("source", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(source):
    assert offending_imports(source, FORBIDDEN[source]) == []


def test_the_engine_parts_live_in_the_engine_package():
    """No engine part lies loose next to the API and the CLI: the folder listing shows where the engine ends."""
    assert {path.stem for path in ROOT.glob("*.py")} == ROOT_MODULES
    assert {"engine", "scheduler", "verification", "output_text", "stop_strings", "prefix_cache", "memory",
            "structured", "outputs", "metrics"} <= {path.stem for path in (ROOT / "engine").glob("*.py")}


def test_the_runtime_never_imports_the_testing_helpers():
    graph = unit_graph()
    assert [source for source in sorted(graph) if "testing" in graph[source] and source != "testing"] == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph, e.g. ["engine", "speculative", "heads", "engine"], or None."""
    done: set[str] = set()

    def visit(path: list[str]) -> list[str] | None:
        for succ in sorted(graph.get(path[-1], ())):
            if succ in path:
                return path[path.index(succ):] + [succ]
            if succ not in done and (cycle := visit(path + [succ])):
                return cycle
        done.add(path[-1])
        return None

    return next((cycle for start in sorted(graph) if start not in done and (cycle := visit([start]))), None)


def test_the_units_import_one_another_without_a_cycle():
    """Such as engine -> speculative -> heads -> engine, which training inside specdec.heads made."""
    assert find_cycle(unit_graph()) is None


def test_the_checks_catch_what_they_forbid(tmp_path, monkeypatch):
    """A copy of the package where a heads module imports the engine inside a function: caught by the rule
    and as a cycle; an import under TYPE_CHECKING is not a dependency."""
    fake = tmp_path / "specdec"
    for path in ROOT.rglob("*.py"):
        (fake / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
        (fake / path.relative_to(ROOT)).write_text(path.read_text())
    (fake / "heads" / "bad.py").write_text("def f():\n    from specdec.engine import Engine\n")
    (fake / "heads" / "typed.py").write_text("from typing import TYPE_CHECKING\n"
                                             "if TYPE_CHECKING:\n    from specdec.api import LLM\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert offending_imports("heads", FORBIDDEN["heads"]) == ["specdec/heads/bad.py: specdec.engine"]
    cycle = find_cycle(unit_graph())
    assert cycle is not None and {"heads", "engine"} <= set(cycle)
