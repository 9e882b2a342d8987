"""The layers, read from the source: every import of every module (module level, inside
functions, under TYPE_CHECKING alike), found with `ast`, never by importing anything.

One import name is ours, `kvbank` (and the unshipped `tests`): the processes' folders sit at
the top of the repository and install as kvbank.worker, kvbank.router, ... (pyproject's
package-dir), so a module's name here is its installed one (worker/tiers/bank.py is
kvbank.worker.tiers.bank).

  floor         kvbank (kvbank.contracts, kvbank.v1 ...)    the floor and third-party only
  harness       kvbank.testing (tiny models, templates)     the floor and third-party only
  processes     kvbank.router, kvbank.worker,               the floor, their own package and
                kvbank.coldstore, kvbank.deploy             third-party; never another
                                                            process, never apps
  applications  kvbank.apps                                 anything of ours but the tests;
                                                            the harness only inside a function
  tests         tests                                       anything; nothing imports tests

Inside the worker, along its data path (WORKER_RULES): kv (cache kinds and their codec)
imports nothing of the worker; link (ZeroMQ, writer, KV events) only kv; memory only the
commands; tiers never compute; commands nothing.

and, across all of them:
  * no module imports a bare `worker`, `router`, `coldstore`, `deploy` or `apps`: those are
    folders, not import names (a distribution of that name would shadow ours, or ours it);
  * no module imports a private name (`_x`, dunders excepted) from another package;
  * every import of one of our packages names a module (or a name in a module) that exists;
  * every `from x import a, b` in the packages pyproject ships, at any depth, names what x
    has: an attribute of module x or a submodule x.a. x (ours, or installed) is imported to
    see; the module holding the statement is not, and no function is called: an import
    inside a function is checked without running it;
  * no cycle between the units above, none between the applications of apps/
    (kvbank.apps.cli, kvbank.apps.loadgen, kvbank.apps.bench, ... each one package), none in
    the module graph of apps/;
  * no module of apps imports kvbank.apps.cli (the command line is the top; nothing builds
    on it).

"Package", for the private-name rule: a unit (the floor, the harness, a process, the tests),
except that each application in apps/ (kvbank.apps.loadgen, kvbank.apps.bench, ...) is its own.

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

pytestmark = pytest.mark.unit  # make test-fast

ROOT = Path(__file__).resolve().parents[1]
FLOOR = "kvbank"
HARNESS = "kvbank.testing"
PROCESSES = ("kvbank.router", "kvbank.worker", "kvbank.coldstore", "kvbank.deploy")
APPS = "kvbank.apps"
TESTS = "tests"
UNITS = (FLOOR, HARNESS, *PROCESSES, APPS, TESTS)
# The folders at the top of the repository and the names they install as.
FOLDERS = {"kvbank": "kvbank", "worker": "kvbank.worker", "router": "kvbank.router",
           "coldstore": "kvbank.coldstore", "deploy": "kvbank.deploy", "apps": "kvbank.apps",
           "tests": "tests"}
BARE = ("worker", "router", "coldstore", "deploy", "apps")  # folders, never import names

# Inside the worker: each part, and the parts of the worker it may import besides itself.
WORKER = "kvbank.worker"
WORKER_RULES = {
    "commands": set(),  # the engine's commands and snapshot: what threads say to it
    "kv": set(),  # cache kinds, arrays, quantization, the block codec
    "link": {"kv"},  # the coldstore's client, the writer, KV events
    "memory": {"commands"},  # pricing, the allocators, the guard
    "tiers": {"kv", "link", "memory", "commands"},  # bank, restore, sharing, prefetch, ...
    "compute": {"kv", "link", "memory", "tiers", "commands"},  # engine, scheduler, decoding
    "server": {"kv", "link", "memory", "tiers", "commands", "compute"},  # the process
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the module it reaches (ours) or the dotted name as written (third-party)
    names: tuple[str, ...]  # `from target import names`; () for `import target`
    written: str  # the module as written in the statement
    path: str  # relative to the repository root
    line: int
    in_function: bool = False  # inside a def: runs when the function does, not on import

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[parts[0]], *parts[1:]])


@cache
def _sources() -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in path.parts and "node_modules" not in path.parts:
                out[_module_name(path)] = path
    return out


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _unit(module: str) -> str:
    """The layer unit a module belongs to (the floor, the harness, a process, apps, tests)."""
    for unit in (HARNESS, *PROCESSES, APPS, TESTS):
        if _within(module, unit):
            return unit
    return FLOOR if _within(module, FLOOR) else module.split(".", 1)[0]


def _package(module: str) -> str:
    """A unit; in apps/, the application (kvbank.apps.loadgen, kvbank.apps.cli, ...)."""
    if _within(module, APPS) and module != APPS:
        return ".".join(module.split(".")[:3])
    return _unit(module)


def _ours(module: str) -> bool:
    return _within(module, FLOOR) or _within(module, TESTS)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve_relative(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([module] if module else [])])


def _in_functions(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a function (they run when it is called)."""
    out = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            out |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


@cache
def _imports() -> tuple[Import, ...]:
    modules = _sources()
    out: list[Import] = []
    for name, path in modules.items():
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=rel)
        inside = _in_functions(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.append(Import(name, alias.name, (), alias.name, rel, node.lineno,
                                      id(node) in inside))
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
                    out.append(Import(name, target, (alias.name,), written, rel, node.lineno,
                                      id(node) in inside))
    return tuple(out)


def _fail(title: str, violations: list[str]) -> None:
    violations = sorted(set(violations))
    if violations:
        pytest.fail(f"{title} ({len(violations)}):\n  " + "\n  ".join(violations),
                    pytrace=False)


# -- layers --------------------------------------------------------------------------------------


def _layer_violation(imp: Import) -> str | None:
    src, dst = _unit(imp.importer), _unit(imp.target)
    if not _ours(imp.target) or src == dst:
        return None
    if src in (FLOOR, HARNESS):
        if src == HARNESS and dst == FLOOR:
            return None
        return f"the {'floor' if src == FLOOR else 'harness'} ({src}) imports {imp.target} ({dst})"
    if src in PROCESSES:
        if dst == FLOOR:
            return None
        kind = ("another process package" if dst in PROCESSES else
                "an application" if dst == APPS else
                "the test harness" if dst == HARNESS else "the tests")
        return f"process {src} imports {imp.target}: {kind}"
    if src == APPS and dst == TESTS:
        return f"application {_package(imp.importer)} imports {imp.target}: the tests"
    if src == APPS and dst == HARNESS and not imp.in_function:
        return (f"application {_package(imp.importer)} imports {imp.target} on import: the "
                f"test harness, only inside the function that needs it")
    return None


def _worker_part(module: str) -> str | None:
    """kv, link, memory, tiers, compute, commands or server (None: not the worker's)."""
    if not _within(module, WORKER) or module == WORKER:
        return None
    return module[len(WORKER) + 1:].split(".", 1)[0]


def _worker_violation(imp: Import) -> str | None:
    src, dst = _worker_part(imp.importer), _worker_part(imp.target)
    if src is None or dst is None or src == dst:
        return None
    if src not in WORKER_RULES:
        return f"{imp.importer}: a part of the worker WORKER_RULES does not name"
    if dst not in WORKER_RULES[src]:
        return f"{imp.importer} ({src}) imports {imp.target} ({dst})"
    return None


def test_each_layer_imports_only_what_is_below_it():
    _fail("imports across layers", [
        f"{imp.where}: {why}" for imp in _imports() if (why := _layer_violation(imp))])


def test_the_worker_imports_along_its_data_path():
    """kv imports nothing of the worker, link only kv, tiers never compute (WORKER_RULES)."""
    parts = {_worker_part(m) for m in _sources()} - {None}
    assert parts == set(WORKER_RULES), parts ^ set(WORKER_RULES)
    _fail("imports against the worker's data path", [
        f"{imp.where}: {why}" for imp in _imports() if (why := _worker_violation(imp))])


def test_no_module_imports_a_folder_as_a_top_level_name():
    """`import worker` would load a second copy of kvbank.worker from a checkout's root (or
    someone else's `worker` distribution): the folders are not import names."""
    _fail("bare imports of our folders", [
        f"{imp.where}: {imp.importer} imports {imp.written}" for imp in _imports()
        if imp.written.split(".", 1)[0] in BARE])


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
              if _unit(imp.importer) != TESTS and imp.names]
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


def test_no_cycle_between_units():
    _fail("import cycles between the floor, the harness, the processes, apps and tests",
          _cycles(_unit))


def test_no_cycle_between_the_parts_of_the_worker():
    _fail("import cycles between the parts of the worker", _cycles(_worker_part))


def test_no_cycle_between_the_applications_of_apps():
    """apps.loadgen must not import apps.bench while apps.bench imports apps.loadgen, and so
    on for every pair and every longer loop."""
    _fail("import cycles between applications in apps/",
          _cycles(lambda m: _package(m) if _unit(m) == APPS else None))


def test_no_cycle_in_the_module_graph_of_apps():
    _fail("import cycles between modules of apps/",
          _cycles(lambda m: m if _unit(m) == APPS else None))


def test_no_module_of_apps_imports_the_command_line():
    _fail("modules of apps/ importing apps.cli", [
        f"{imp.where}: {imp.importer} imports {imp.target}" for imp in _imports()
        if _unit(imp.importer) == APPS and _package(imp.importer) != "kvbank.apps.cli"
        and _package(imp.target) == "kvbank.apps.cli"])


# -- the checker itself, on a graph it knows -------------------------------------------------


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "x": {"y"},
             "y": {"x"}}
    comps = _strongly_connected(edges)
    assert comps == [["a", "b", "c"], ["x", "y"]]
    assert _one_cycle(["a", "b", "c"], edges) == ["a", "b", "c", "a"]
    assert _strongly_connected({"a": {"b"}, "b": {"c"}}) == []


def test_the_walk_sees_imports_inside_functions_and_every_package():
    found = {(imp.importer, imp.target, imp.in_function) for imp in _imports()}
    assert {_unit(m) for m in _sources()} == set(UNITS)
    assert _module_name(ROOT / "worker" / "tiers" / "bank.py") == "kvbank.worker.tiers.bank"
    assert _module_name(ROOT / "apps" / "__init__.py") == "kvbank.apps"
    # tests/conftest.py imports kvbank.models inside its fixtures only.
    assert ("tests.conftest", "kvbank.models", True) in found
    assert ("kvbank.worker.server", "kvbank.worker.compute.engine", False) in found
    assert (_resolve_relative("kvbank.apps.loadgen.run", False, 1, "targets")
            == "kvbank.apps.loadgen.targets")
    assert _resolve_relative("kvbank.apps.loadgen", True, 2, "bench") == "kvbank.apps.bench"


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
    def imp(importer, target, in_function=False):
        return Import(importer, target, (), target, "x.py", 1, in_function)

    W = WORKER
    refused = [("kvbank.events", f"{W}.tiers.bank"), ("kvbank.contracts.receipts", f"{APPS}.cli"),
               ("kvbank.router.server", f"{W}.tiers.bank"),
               (f"{W}.compute.engine", "kvbank.coldstore.store"),
               ("kvbank.coldstore.server", f"{APPS}.bench.components.bank"),
               ("kvbank.deploy.local", f"{APPS}.cli"), (f"{W}.compute.engine", "tests.waiting"),
               (f"{APPS}.loadgen.run", "tests.waiting"), ("kvbank.models", "kvbank.testing.tiny"),
               (f"{W}.compute.served_model", "kvbank.testing.tiny"),
               (f"{APPS}.cli", "kvbank.testing.tiny"), ("kvbank.testing.tiny", f"{W}.kv.arrays")]
    allowed = [("kvbank.client", "kvbank.v1.api_pb2"), ("kvbank.blocks", "numpy"),
               (f"{W}.compute.engine", "kvbank.blocks"),
               (f"{W}.compute.engine", f"{W}.tiers.bank"),
               ("kvbank.deploy.local", "kvbank.config"), (f"{APPS}.cli", f"{W}.server"),
               (f"{APPS}.bench.compare", f"{APPS}.loadgen.run"),
               ("tests.test_bank", f"{W}.tiers.bank"), ("kvbank.testing.tiny", "kvbank.models"),
               ("tests.conftest", "kvbank.testing.tiny")]
    assert [p for p in refused if _layer_violation(imp(*p)) is None] == []
    assert [(p, _layer_violation(imp(*p))) for p in allowed if _layer_violation(imp(*p))] == []
    assert _layer_violation(imp(f"{APPS}.bench.turn", "kvbank.testing.tiny", True)) is None
    worker_refused = [(f"{W}.kv.arrays", f"{W}.tiers.bank"), (f"{W}.kv.codec", f"{W}.link.writer"),
                      (f"{W}.link.writer", f"{W}.tiers.bank"),
                      (f"{W}.tiers.sharing", f"{W}.compute.scheduler"),
                      (f"{W}.memory.guard", f"{W}.compute.engine"),
                      (f"{W}.commands", f"{W}.tiers.bank")]
    worker_allowed = [(f"{W}.tiers.bank", f"{W}.kv.arrays"), (f"{W}.link.writer", f"{W}.kv.codec"),
                      (f"{W}.compute.engine", f"{W}.tiers.manager"),
                      (f"{W}.server", f"{W}.compute.engine"), (f"{W}.kv.codec", f"{W}.kv.arrays"),
                      (f"{W}.tiers.bank", "kvbank.blocks")]
    assert [p for p in worker_refused if _worker_violation(imp(*p)) is None] == []
    assert [p for p in worker_allowed if _worker_violation(imp(*p))] == []


def test_every_worker_thread_is_in_the_owners_table():
    """docs/architecture.md's table of who owns each piece of state names every thread the
    worker starts (by the name it gives the thread), and no thread that does not exist."""
    import re

    table = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\| worker: `([a-z-]+)`", table))
    started = set()
    for path in (ROOT / "worker").rglob("*.py"):
        text = path.read_text()
        started |= set(re.findall(r'threading\.Thread\([^)]*name="([a-z-]+)"', text))
        started |= set(re.findall(r'thread_name_prefix="([a-z-]+)"', text))
    assert started, "no worker thread found: the pattern is stale"
    assert started <= named, f"threads missing from the owners table: {started - named}"
    assert named <= started, f"the owners table names threads the worker has not: {named - started}"


def test_the_unit_tier_is_marked_and_starts_no_stack():
    """`make test-fast` runs the tests marked `unit` (a file's `pytestmark`), and none of
    those files starts a stack."""
    import re

    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-fast:.*\n\t.*pytest .*-m unit \$\(UNIT_TESTS\)", make, re.M)
    assert re.search(r"^UNIT_TESTS = .*grep -l '\^pytestmark = \.\*pytest\\\.mark\\\.unit' "
                     r"tests/test_\*\.py", make, re.M)
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py"))
              if re.search(r"^pytestmark = .*pytest\.mark\.unit", p.read_text(), re.M)]
    assert len(marked) >= 15
    for path in marked:
        assert not re.search(r"start_stack\(|LocalStack\.start|ClusterStack\.start",
                             path.read_text()), f"{path.name} starts a stack"


def test_the_engine_asks_the_kv_manager_alone_about_kv():
    """The engine reaches the KV tiers through one object, the KV manager: it imports nothing
    else of worker/tiers, and asks `self.kv` only what the manager offers (its calls below)."""
    engine = ROOT / "worker" / "compute" / "engine.py"
    tiers = {imp.target for imp in _imports() if imp.importer == f"{WORKER}.compute.engine"
             and _within(imp.target, f"{WORKER}.tiers")}
    assert tiers == {f"{WORKER}.tiers.manager"}, tiers
    asked = set()
    for node in ast.walk(ast.parse(engine.read_text())):
        if isinstance(node, ast.Attribute) and (
                isinstance(node.value, ast.Name) and node.value.id == "kv"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "kv"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"):
            asked.add(node.attr)
    requests = {"admit", "start", "ready", "take", "reserve", "unreserve", "hold_leave",
                "forward_bytes", "prompt_read", "copies_history", "abandon", "leave", "share",
                "commit", "turns_ended"}
    loop = {"pump", "set_busy", "land", "refresh", "ledger", "published", "flush_events",
            "reading", "reading_of", "stop", "close"}
    commands = {"delete", "release", "trim", "flush", "receipts", "pressure", "probe", "hint",
                "history", "announce", "tick"}
    assert asked and asked <= requests | loop | commands, asked - (requests | loop | commands)
