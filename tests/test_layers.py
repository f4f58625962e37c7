"""The house's layout holds: no import circle inside `harness/`, and no import from a lower
layer up to a higher one. Read from the sources (every import, also those inside functions),
so a new module that breaks the layering fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path
from tests._machine import PACKAGE

HARNESS = PACKAGE

# Top to bottom: a module may import its own layer's modules and those of lower layers. Each
# sub-package of harness/ is one room of a layer (docs/architecture.md).
LAYERS = [
    {"harness.__main__", "harness.commands"},  # the commands
    {"harness.campaigns", "harness.plugin"},  # the campaigns and the pytest plugin, side by side
    {"harness.runs"},  # the run layer the campaigns and the comparison stand on
    {"harness.pool"},  # the warm pool's processes
    {"harness.library"},  # the gate author's library
    {"harness.compiling"},  # the compile path
    {"harness.core"},  # the foundations: settings, errors, records, the gate vocabulary, the child builder
]
# may not import each other
SIDE_BY_SIDE = [("harness.campaigns.controls", "harness.campaigns.mutate"), ("harness.campaigns", "harness.plugin")]


def module_name(path: Path, root: Path = HARNESS) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = HARNESS) -> set[str]:
    """Every harness module `path` (under `root`, the harness folder) imports, anywhere in it,
    and every plugin it has pytest load by name (`pytest_plugins`): a by-name load is an arrow."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytest_plugins" for t in node.targets):
            found |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    modules = {module_name(p, root) for p in root.rglob("*.py")}
    return {m for m in found if m in modules and m != name}


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return len(LAYERS)


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in HARNESS.rglob("*.py")}


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts if layer(t) < layer(m))


def crossing(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts for a, b in SIDE_BY_SIDE
                  if (m.startswith(a) and t.startswith(b)) or (m.startswith(b) and t.startswith(a)))


def circles(g: dict[str, set[str]]) -> list[str]:
    """Each loop found by a depth-first walk (a package and its own modules aside)."""
    state: dict[str, int] = {}
    found = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1 and t in path and not (m.startswith(t + ".") or t.startswith(m + ".")):
                found.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_from_a_lower_layer_up_to_a_higher_one():
    assert upward(graph()) == [], "imports that run back up:\n" + "\n".join(upward(graph()))


def test_the_two_campaigns_import_nothing_of_each_other():
    assert crossing(graph()) == [], "\n".join(crossing(graph()))


def test_no_import_circle():
    assert circles(graph()) == [], "\n".join(circles(graph()))


def test_each_check_notices_what_it_forbids():
    g = graph()
    assert "harness.runs.sandbox" in g and "harness.core.records" in g and "harness.campaigns.mutate.campaign" in g
    assert upward({**g, "harness.runs.sandbox": g["harness.runs.sandbox"] | {"harness.campaigns.mutate.campaign"}}) == [
        "harness.runs.sandbox -> harness.campaigns.mutate.campaign"]
    assert crossing({**g, "harness.campaigns.controls.runner": g["harness.campaigns.controls.runner"] | {"harness.campaigns.mutate.execute"}}) == [
        "harness.campaigns.controls.runner -> harness.campaigns.mutate.execute"]
    looped = {**g, "harness.core.records": g["harness.core.records"] | {"harness.core.device"},
              "harness.core.device": g["harness.core.device"] | {"harness.core.records"}}
    assert any("harness.core.device" in c and "harness.core.records" in c for c in circles(looped))


def test_imports_are_read_also_inside_functions_and_relative(tmp_path):
    root = tmp_path / "harness"
    for rel in ("__init__.py", "core/__init__.py", "core/records.py", "core/device.py", "runs/__init__.py",
                "runs/result.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    probe = root / "runs" / "probe.py"
    probe.write_text("def f():\n    from harness.core.records import Outcome\n    import harness.core.device\n"
                     "    from .result import GateRuns\n"
                     "pytest_plugins = ['harness.runs'] + (['harness.core.records'] if f else [])\n")
    assert imports(probe, root) == {"harness.core.records", "harness.core.device", "harness.runs.result", "harness.runs"}
