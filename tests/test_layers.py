"""The layers stay layers: protocols import nothing of ours, actors never reach the daemon's side,
and the package's modules import each other without a circle (lazy imports count too)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocols", "actors", "lever_actors")


def _imports(path: Path) -> set[str]:
    """Every module of ours that ``path`` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).glob("*.py"):
            modules[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return {m: {i for i in _imports(f) if i in modules and i != m} for m, f in modules.items()}


def test_protocols_import_nothing_of_ours():
    for mod, deps in _graph().items():
        if mod.split(".")[0] == "protocols":
            assert all(d.split(".")[0] == "protocols" for d in deps), (mod, deps)


def test_actors_never_import_the_daemon_or_the_driver():
    above = {"lever_actors.daemon", "lever_actors.service", "lever_actors.engine", "lever_actors.runtime",
             "lever_actors.driver", "lever_actors.cli", "lever_actors.client", "lever_actors.bench"}
    for mod, deps in _graph().items():
        if mod.split(".")[0] == "actors":
            assert not deps & above, (mod, deps & above)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a list of modules, first = last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (circle := visit(d, stack + [d])):
                return circle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m, [m])):
            return circle
    return None


def test_no_import_circle():
    circle = find_circle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports():
    """The checks above are only as good as the graph: it must see the driver's known edges."""
    g = _graph()
    assert "lever_actors.driver" in g["lever_actors.runtime"]
    assert "lever_actors.speculation" in g["lever_actors.driver"]
    assert "protocols" in g["actors.draft"]


def test_the_native_path_never_imports_onnx():
    # onnx alone held 13 MiB of the process, which --dram-budget counts; only the ORT layout needs it
    import subprocess
    import sys

    code = ("import sys, lever_actors.cli, lever_actors.engine, lever_actors.runtime, lever_actors.service, "
            "lever_actors.daemon, lever_actors.bench, lever_actors.model, lever_actors.bundle; "
            "print(sorted(m for m in ('onnx', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_shapes_declare_the_onnx_element_types():
    # the shapes module carries no ONNX codes: the graph builder declares packed blocks as bytes, the rest as floats
    from onnx import TensorProto

    from lever_actors.graphs import array_shapes
    from lever_actors.shapes import MatSpec

    q4 = array_shapes(MatSpec("q4", k=64, n=8, block=32, has_corr=True))
    assert {k: t for k, (_, t) in q4.items()} == {"packed": TensorProto.UINT8, "scales": TensorProto.FLOAT,
                                                  "corr": TensorProto.FLOAT}
    assert q4["packed"][0] == (8, 2, 16)
    assert array_shapes(MatSpec("f32", k=4, n=3))["dense"] == ((4, 3), TensorProto.FLOAT)
