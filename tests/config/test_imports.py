"""The package's import graph: every module imports alone in a fresh process, and the graph
of imports between package modules (module level and inside functions alike) has no cycle."""
import ast
import importlib.util
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import megatron_taper

PACKAGE = Path(megatron_taper.__file__).resolve().parent


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name, found on disk (nothing is imported)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("megatron_taper",) + path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules `name` imports anywhere in its file, inside functions too (not counted: a
    parent package, whose __init__ runs on any submodule import without being a dependency of the
    code, and imports under `if TYPE_CHECKING:`, which never run)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _runtime_nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        test = node.test if isinstance(node, ast.If) else None
        if test is not None and "TYPE_CHECKING" in ast.unparse(test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 30 and "megatron_taper.cost.memory" in graph["megatron_taper.parallel.block_options"]
    assert "megatron_taper.parallel.dp.zero_deepspeed" in graph["megatron_taper.parallel.dp.fsdp2"]  # in a function
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _import_alone(name: str) -> tuple[str, str | None]:
    """In a process forked from the preloaded server, with every module of the package forgotten
    first (the server may be the one tests/helpers/harness.py started, which preloads some)."""
    import importlib
    import traceback

    for module in [m for m in sys.modules if m == "megatron_taper" or m.startswith("megatron_taper.")]:
        del sys.modules[module]
    try:
        importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - reported by the test
        return name, traceback.format_exc()[-2000:]
    return name, None


def test_every_module_imports_alone():
    """Each module in a fresh process forked from a server that imported torch and the large
    third-party packages once (no module of this package): import cycles and missing imports show,
    and a module costs milliseconds instead of a fresh interpreter's seconds (the server is a
    per-process singleton: under pytest-xdist it may be the gloo harness's, preloaded alike)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "yaml", "safetensors",
                                *[m for m in ("transformers", "streaming") if importlib.util.find_spec(m)]])
    with ProcessPoolExecutor(max_workers=2, mp_context=ctx, max_tasks_per_child=1) as pool:
        failures = [r for r in pool.map(_import_alone, sorted(package_modules())) if r[1] is not None]
    assert not failures, "\n\n".join(f"{name}:\n{err}" for name, err in failures)
