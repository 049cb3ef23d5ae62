"""The package layout the README's code map describes, read from the source with `ast`:
no import cycles (lazy imports inside functions count), a root of the CLI and subpackages
only, ground floors (`core/`, `rundir/`) that import nothing above them, commands that import
no other command, a cluster model below the process layer and the commands, and tools/ holding
scripts only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "titan_async"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_modules(path: Path) -> set[str]:
    """The titan_async modules `path` imports anywhere in its body: `from P import name` counts
    P.name when that is a module, else P."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in MODULES:
                    found.add(child)
                elif node.module in MODULES:
                    found.add(node.module)
    found.discard(_module_name(path))
    return found


GRAPH = {name: imported_modules(path) for name, path in MODULES.items()}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_graph_sees_imports():
    assert "titan_async.run.worker" in GRAPH["titan_async.run.launch"]
    assert "titan_async.config.assemble" in GRAPH["titan_async.run.worker"]  # imported inside a function


def test_no_module_imports_one_that_imports_it_back():
    cycles = sorted(name for name in GRAPH if name in reachable(name))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_root_holds_cli_and_subpackages_only():
    files = {p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files <= {"__init__.py", "__main__.py", "cli.py"}, sorted(files)
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = folder / "__init__.py"
        assert init.is_file(), f"{folder.name}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{folder.name}/__init__.py says nothing of what it owns"


def package_of(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def test_ground_floors_import_nothing_above_them():
    """`core/` imports no other package of ours, and the run-directory store (`rundir/`) only
    `core/`: following an import never climbs from them to config/, train/ or the process layer."""
    allowed = {"core": {"core"}, "rundir": {"rundir", "core"}}
    climbing = [(name, target) for name in GRAPH if package_of(name) in allowed
                for target in GRAPH[name] if package_of(target) not in allowed[package_of(name)]]
    assert not climbing, climbing


def test_no_command_imports_another():
    def command(name: str) -> str | None:
        parts = name.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "commands" and parts[2] != "pages" else None

    crossing = [(name, target) for name in GRAPH if command(name)
                for target in GRAPH[name] if command(target) not in (None, command(name))]
    assert not crossing, crossing


def test_code_map_matches_the_tree():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Code map", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"`titan_async/(\w+)/`", section))
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert mapped == packages


def test_tools_hold_scripts_only():
    scripts = [p for p in (REPO / "tools").rglob("*.py") if "shim" not in p.parts]  # the shim is a sitecustomize hook
    siblings = {p.stem for p in scripts}
    for script in scripts:
        tree = ast.parse(script.read_text())
        assert "__main__" in script.read_text(), f"{script} is not a script"
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & siblings, f"{script} imports another tool; shared code belongs in titan_async.experiments"


def test_the_cluster_model_lies_below_the_process_layer_and_the_commands():
    """`cluster/` (memory estimate, fits, simulation costs, the advisor's search), which `plan`
    renders and the launcher's checks use, imports neither `run/` nor any command; and the
    process layer (`run/`) reaches no command for it."""
    assert {"titan_async.cluster.estimate", "titan_async.cluster.fits", "titan_async.cluster.simulate"} <= GRAPH.keys()
    above = sorted((name, imported) for name in GRAPH if package_of(name) == "cluster"
                   for imported in GRAPH[name] if package_of(imported) in ("run", "commands"))
    assert not above, above
    commands = sorted((name, imported) for name in GRAPH if package_of(name) == "run"
                      for imported in GRAPH[name] if package_of(imported) == "commands")
    assert not commands, commands
