"""The layers, read from the source: every import of every module (module level, inside
functions, under TYPE_CHECKING alike), found with `ast`, never by importing anything.

  floor         kvbank (kvbank.contracts, kvbank.v1 ...)    kvbank.* and third-party only
  processes     router, worker, coldstore, deploy           kvbank.*, their own package and
                                                            third-party; never another
                                                            process, never apps
  applications  apps                                        anything of ours
  tests         tests                                       anything; nothing imports tests

and, across all of them:
  * no module imports a private name (`_x`, dunders excepted) from another package;
  * every import of one of our packages names a module (or a name in a module) that exists;
  * every `from x import a, b` in the packages pyproject ships (kvbank, apps, router, worker,
    coldstore, deploy), at any depth, names what x has: an attribute of module x or a
    submodule x.a. x (ours, or installed) is imported to see; the module holding the statement
    is not, and no function is called: an import inside a function is checked without
    running it;
  * no cycle between top-level packages, none between the applications of apps/ (apps.cli,
    apps.loadgen, apps.bench, ... each one package), none in the module graph of apps/;
  * no module of apps imports apps.cli (the command line is the top; nothing builds on it).

"Package", for the private-name rule: a top-level package, except that each application in
apps/ (apps.loadgen, apps.bench, apps.cli, ...) is its own.

Every failure lists every violation as path:line.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "kvbank"
PROCESSES = ("router", "worker", "coldstore", "deploy")
APPS = "apps"
TESTS = "tests"
OURS = (FLOOR, *PROCESSES, APPS, TESTS)
SHIPPED = (FLOOR, *PROCESSES, APPS)  # pyproject's [tool.setuptools.packages.find]


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the module it reaches (ours) or the dotted name as written (third-party)
    names: tuple[str, ...]  # `from target import names`; () for `import target`
    written: str  # the module as written in the statement
    path: str  # relative to the repository root
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _sources() -> dict[str, Path]:
    out = {}
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts and "node_modules" not in path.parts:
                out[_module_name(path)] = path
    return out


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _package(module: str) -> str:
    """A top-level package; in apps/, the application (apps.loadgen, apps.cli, ...)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == APPS and len(parts) > 1 else parts[0]


def _ours(module: str) -> bool:
    return _top(module) in OURS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


@cache
def _imports() -> tuple[Import, ...]:
    modules = _sources()
    out: list[Import] = []
    for name, path in modules.items():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.append(Import(name, alias.name, (), alias.name, rel, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                written = node.module or ""
                if node.level:
                    written = _resolve_relative(name, path.name == "__init__.py", node.level,
                                                node.module)
                if written == "__future__":
                    continue
                for alias in node.names:
                    # `from a.b import c`: c is a submodule when a/b/c.py exists, else a name.
                    sub = f"{written}.{alias.name}"
                    target = sub if sub in modules else written
                    out.append(Import(name, target, (alias.name,), written, rel, node.lineno))
    return tuple(out)


def _fail(title: str, violations: list[str]) -> None:
    violations = sorted(set(violations))
    if violations:
        pytest.fail(f"{title} ({len(violations)}):\n  " + "\n  ".join(violations),
                    pytrace=False)


# -- layers --------------------------------------------------------------------------------------


def _layer_violation(imp: Import) -> str | None:
    src, dst = _top(imp.importer), _top(imp.target)
    if not _ours(imp.target) or src == dst:
        return None
    if src == FLOOR:
        return f"the floor ({FLOOR}) imports {imp.target} ({dst})"
    if src in PROCESSES:
        if dst == FLOOR:
            return None
        kind = ("another process package" if dst in PROCESSES else
                "an application" if dst == APPS else "the tests")
        return f"process {src} imports {imp.target}: {kind}"
    if src == APPS and dst == TESTS:
        return f"application {_package(imp.importer)} imports {imp.target}: the tests"
    return None


def test_each_layer_imports_only_what_is_below_it():
    _fail("imports across layers", [
        f"{imp.where}: {why}" for imp in _imports() if (why := _layer_violation(imp))])


def test_no_private_name_is_imported_from_another_package():
    bad = []
    for imp in _imports():
        if not _ours(imp.written) or _package(imp.written) == _package(imp.importer):
            continue
        private = [p for p in imp.written.split(".") if _private(p)]
        private += [n for n in imp.names if _private(n)]
        for name in private:
            bad.append(f"{imp.where}: {imp.importer} imports private {name} from "
                       f"{imp.written} (package {_package(imp.written)})")
    _fail("private names imported from another package", bad)


def test_every_import_of_ours_exists():
    """A module that moved or was split leaves no import behind that names its old place."""
    modules = _sources()
    bad = []
    for imp in _imports():
        if not _ours(imp.written):
            continue
        if imp.target not in modules:
            bad.append(f"{imp.where}: {imp.importer} imports {imp.target}: no such module")
    _fail("imports of modules that do not exist", bad)


# -- names ---------------------------------------------------------------------------------------


def _has(module, name: str) -> bool:
    """What `from module import name` finds: an attribute, else a submodule (imported then)."""
    if hasattr(module, name):
        return True
    if not hasattr(module, "__path__"):  # not a package: no submodules
        return False
    try:
        return importlib.util.find_spec(f"{module.__name__}.{name}") is not None
    except (ImportError, ValueError):
        return False


def _missing_names(checks: list[tuple[str, list[str], str]]) -> list[str]:
    """For each (module, names, where): the names the module lacks, or why it did not import.
    A module that is not ours and not installed is skipped (an optional dependency)."""
    bad = []
    for written, names, where in checks:
        try:
            module = importlib.import_module(written)
        except ModuleNotFoundError as e:
            absent = e.name is not None and (written + ".").startswith(e.name + ".")
            if not absent or _ours(written):  # ours, or one that is there but broken
                bad.append(f"{where}: from {written} import ...: {type(e).__name__}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - whatever breaks the import is the finding
            bad.append(f"{where}: from {written} import ...: {type(e).__name__}: {e}")
            continue
        bad += [f"{where}: {written} has no {name}" for name in names
                if name != "*" and not _has(module, name)]
    return bad


CHILD = """
import json, sys
from kvbank.config import preload_openblas
preload_openblas()  # before anything imports mlx, as every entry point does
from tests.test_layers import _missing_names
json.dump(_missing_names(json.load(sys.stdin)), sys.stdout)
"""


def test_every_name_imported_exists():
    """A name that moved or was renamed leaves no `from x import name` behind, not even one
    inside a function that only a rarely run command reaches. The modules are imported in a
    child process, so what they do on import stays out of this test session."""
    checks = [(imp.written, list(imp.names), imp.where) for imp in _imports()
              if _top(imp.importer) in SHIPPED and imp.names]
    assert checks
    out = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(checks), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    _fail("imports of names that do not exist", json.loads(out.stdout))


# -- cycles --------------------------------------------------------------------------------------


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one node, sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    nodes = sorted(set(edges) | {d for ds in edges.values() for d in ds})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    n = stack.pop()
                    on_stack.discard(n)
                    comp.append(n)
                    if n == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _one_cycle(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first node."""
    start, members = comp[0], set(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child == start:
                    return [*paths[node], start]
                if child in members and child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    return comp


def _cycles(node_of, keep=lambda imp: True) -> list[str]:
    """Cycles in the graph whose nodes are `node_of(module)` (None: not in the graph); each
    reported with one cycle and every import that makes an edge of its component."""
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for imp in _imports():
        if not (_ours(imp.target) and keep(imp)):
            continue
        a, b = node_of(imp.importer), node_of(imp.target)
        if a is None or b is None or a == b:
            continue
        edges[a].add(b)
        where[(a, b)].append(f"{imp.where} ({imp.importer} -> {imp.target})")
    out = []
    for comp in _strongly_connected(edges):
        members = set(comp)
        lines = [f"cycle {' -> '.join(_one_cycle(comp, edges))}; the imports that close it:"]
        for (a, b), places in sorted(where.items()):
            if a in members and b in members:
                lines += [f"    {p}" for p in sorted(places)]
        out.append("\n  ".join(lines))
    return out


def test_no_cycle_between_top_level_packages():
    _fail("import cycles between top-level packages", _cycles(_top))


def test_no_cycle_between_the_applications_of_apps():
    """apps.loadgen must not import apps.bench while apps.bench imports apps.loadgen, and so
    on for every pair and every longer loop."""
    _fail("import cycles between applications in apps/",
          _cycles(lambda m: _package(m) if _top(m) == APPS else None))


def test_no_cycle_in_the_module_graph_of_apps():
    _fail("import cycles between modules of apps/",
          _cycles(lambda m: m if _top(m) == APPS else None))


def test_no_module_of_apps_imports_the_command_line():
    _fail("modules of apps/ importing apps.cli", [
        f"{imp.where}: {imp.importer} imports {imp.target}" for imp in _imports()
        if _top(imp.importer) == APPS and _package(imp.importer) != "apps.cli"
        and _package(imp.target) == "apps.cli"])


# -- the checker itself, on a graph it knows -------------------------------------------------


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "x": {"y"},
             "y": {"x"}}
    comps = _strongly_connected(edges)
    assert comps == [["a", "b", "c"], ["x", "y"]]
    assert _one_cycle(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert _strongly_connected({"a": {"b"}, "b": {"c"}}) == []


def test_the_walk_sees_imports_inside_functions_and_every_package():
    found = {(imp.importer, imp.target) for imp in _imports()}
    assert {_top(m) for m in _sources()} == set(OURS)
    # tests/conftest.py imports kvbank.models inside its fixtures only.
    assert ("tests.conftest", "kvbank.models") in found
    assert _resolve_relative("apps.loadgen.run", False, 1, "targets") == "apps.loadgen.targets"
    assert _resolve_relative("apps.loadgen", True, 2, "bench") == "apps.bench"


def test_the_name_check_on_names_it_knows():
    assert _missing_names([
        ("os", ["path", "sep"], "a.py:1"),  # attributes
        ("xml", ["dom"], "a.py:2"),  # a submodule the package does not import itself
        ("os", ["no_such_name"], "a.py:3"),
        ("kvbank", ["no_such_module"], "a.py:4"),
        ("kvbank.no_such_module", ["x"], "a.py:5"),  # ours: reported
        ("no_such_dependency_xyz", ["x"], "a.py:6"),  # not installed: an optional one
    ]) == ["a.py:3: os has no no_such_name", "a.py:4: kvbank has no no_such_module",
           "a.py:5: from kvbank.no_such_module import ...: ModuleNotFoundError: "
           "No module named 'kvbank.no_such_module'"]


def test_the_layer_rule_on_imports_it_knows():
    def imp(importer, target):
        return Import(importer, target, (), target, "x.py", 1)

    refused = [("kvbank.events", "worker.bank"), ("kvbank.contracts.receipts", "apps.cli"),
               ("router.server", "worker.bank"), ("worker.engine", "coldstore.store"),
               ("coldstore.server", "apps.bench.bank"), ("deploy.local", "apps.cli"),
               ("worker.engine", "tests.waiting"), ("apps.loadgen.run", "tests.waiting")]
    allowed = [("kvbank.client", "kvbank.v1.api_pb2"), ("kvbank.blocks", "numpy"),
               ("worker.engine", "kvbank.blocks"), ("worker.engine", "worker.bank"),
               ("deploy.local", "kvbank.config"), ("apps.cli", "worker.server"),
               ("apps.bench.compare", "apps.loadgen.run"), ("tests.test_bank", "worker.bank")]
    assert [p for p in refused if _layer_violation(imp(*p)) is None] == []
    assert [(p, _layer_violation(imp(*p))) for p in allowed if _layer_violation(imp(*p))] == []


def test_every_worker_thread_is_in_the_owners_table():
    """docs/architecture.md's table of who owns each piece of state names every thread the
    worker starts (by the name it gives the thread), and no thread that does not exist."""
    import re

    table = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\| worker: `([a-z-]+)`", table))
    started = set()
    for path in (ROOT / "worker").glob("*.py"):
        text = path.read_text()
        started |= set(re.findall(r'threading\.Thread\([^)]*name="([a-z-]+)"', text))
        started |= set(re.findall(r'thread_name_prefix="([a-z-]+)"', text))
    assert started, "no worker thread found: the pattern is stale"
    assert started <= named, f"threads missing from the owners table: {started - named}"
    assert named <= started, f"the owners table names threads the worker has not: {named - started}"


def test_make_test_fast_names_unit_test_files_that_exist_and_start_no_stack():
    """`make test-fast` stays the unit tier: its files exist and none starts a stack."""
    import re

    text = (ROOT / "Makefile").read_text()
    block = re.search(r"FAST_TESTS := ((?:.*\\\n)*.*)", text).group(1)
    names = block.replace("\\", " ").split()
    assert len(names) >= 10
    for name in names:
        path = ROOT / "tests" / f"test_{name}.py"
        assert path.exists(), path
        assert not re.search(r"start_stack\(|LocalStack\.start|ClusterStack\.start",
                             path.read_text()), f"{path.name} starts a stack"
