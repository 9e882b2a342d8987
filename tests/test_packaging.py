"""What an install of kvbank puts on a user's path: one import name, `kvbank`, and its
command. The processes' folders stay at the top of the repository (worker/, router/, ...) and
install as kvbank.worker, kvbank.router, ... (pyproject's package-dir); README's layout names
every module there is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = ("kvbank", "worker", "router", "coldstore", "deploy", "apps")
UNSHIPPED = ("apps/bench/components",)  # run from a checkout: apps/bench/__init__.py
GENERATED = ("kvbank/v1",)  # make proto


def _installed_name(folder: Path) -> str:
    rel = folder.relative_to(ROOT).parts
    return ".".join(rel if rel[0] == "kvbank" else ("kvbank", *rel))


def _package_folders() -> list[Path]:
    return sorted(p.parent for top in FOLDERS for p in (ROOT / top).rglob("__init__.py")
                  if "__pycache__" not in p.parts)


def test_pyproject_ships_every_package_folder_under_kvbank():
    tool = PYPROJECT["tool"]["setuptools"]
    shipped = set(tool["packages"])
    want = {_installed_name(f) for f in _package_folders()
            if str(f.relative_to(ROOT)) not in UNSHIPPED}
    want |= {"kvbank.testing.templates",  # data: the test chat templates,
             "kvbank.testing.templates.families"}  # the published ones among them
    assert shipped == want, f"pyproject's packages and the folders differ: {shipped ^ want}"
    assert all(name == "kvbank" or name.startswith("kvbank.") for name in shipped)
    assert tool["package-dir"] == {f"kvbank.{top}": top for top in FOLDERS if top != "kvbank"}
    assert PYPROJECT["project"]["scripts"] == {"kvbank": "kvbank.apps.cli:main"}


def test_the_installed_kvbank_adds_no_other_import_name():
    """From outside the checkout (whose root a test run puts on sys.path), the folders are
    not importable by their own names; kvbank's parts are, under kvbank."""
    code = ("import importlib.util as u\n"
            "print([n for n in ('worker', 'router', 'coldstore', 'deploy', 'apps') "
            "if u.find_spec(n) is not None])\n"
            "print(all(u.find_spec(n) is not None for n in ('kvbank.worker.compute.engine', "
            "'kvbank.router.server', 'kvbank.coldstore.server', 'kvbank.deploy.supervisor', "
            "'kvbank.apps.cli', 'kvbank.apps.bench.components.bank')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True"]
    bare = subprocess.run([sys.executable, "-c", "import worker"], cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert bare.returncode == 1 and "No module named 'worker'" in bare.stderr


def test_a_wheel_holds_kvbank_alone_and_no_component_bench(tmp_path):
    """The wheel built from the repository: every file under kvbank/ (and its metadata), the
    processes inside it, the harness's templates as data, and no component bench."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top in FOLDERS:
        shutil.copytree(ROOT / top, src / top,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("kvbank-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"kvbank", wheel.name.split("-py3")[0]
                                               + ".dist-info"}
    for path in ("kvbank/worker/tiers/bank.py", "kvbank/worker/compute/engine.py",
                 "kvbank/apps/cli.py", "kvbank/apps/bench/turn.py", "kvbank/router/server.py",
                 "kvbank/coldstore/server.py", "kvbank/deploy/supervisor.py",
                 "kvbank/testing/tiny.py", "kvbank/testing/templates/qwen_tools.jinja",
                 "kvbank/testing/templates/families/gpt_oss.jinja",
                 "kvbank/v1/api_pb2.py"):
        assert path in names, path
    assert not [n for n in names if "/components/" in n]
    entry = zipfile.ZipFile(wheel).read(next(n for n in names
                                             if n.endswith("entry_points.txt"))).decode()
    assert "kvbank = kvbank.apps.cli:main" in entry


def _readme_layout() -> dict[str, str]:
    """README's layout block: folder -> the text of its entry (its line and the indented ones
    under it)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Layout\n.*?```\n(.*?)```", text, re.S).group(1)
    out, folder = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, rest = line.partition(" ")
            out[folder] = rest
        elif folder is not None:
            out[folder] += " " + line.strip()
    return out


def test_readme_layout_names_every_module_and_nothing_else():
    layout = _readme_layout()
    folders = {str(f.relative_to(ROOT)) + "/" for f in _package_folders()
               if str(f.relative_to(ROOT)) not in GENERATED}
    assert folders <= set(layout), f"README's layout lacks {sorted(folders - set(layout))}"
    bad = []
    for folder, entry in layout.items():
        path = ROOT / folder
        assert path.is_dir(), f"README's layout names {folder}, which does not exist"
        if folder not in folders:
            continue
        listed = set(re.findall(r"(?<![\w/*.])(\w+\.py)\b", entry))
        there = {p.name for p in path.glob("*.py")} - {"__init__.py"}
        bad += [f"{folder}{n}: not in README's layout" for n in sorted(there - listed)]
        bad += [f"{folder}{n}: in README's layout, not in the repository"
                for n in sorted(listed - there - {"__init__.py"})]
    assert not bad, "\n".join(bad)


def test_the_life_of_a_returning_turn_walks_at_most_eight_files_that_exist():
    """docs/returning-turn.md follows a returning conversation's KV from LMDB into the request
    and back in a table of at most eight files; each exists, and each function it names there
    is defined in the code (a rename leaves the page behind: this fails)."""
    page = (ROOT / "docs" / "returning-turn.md").read_text()
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| (.*) \|$", page, re.M)
    assert 0 < len(rows) <= 8, len(rows)
    defined = set()
    for top in ("worker", "coldstore"):
        for path in (ROOT / top).rglob("*.py"):
            defined |= set(re.findall(r"^\s*def (\w+)\(", path.read_text(), re.M))
    for path, text in rows:
        assert (ROOT / path).is_file(), path
        named = {n for n in re.findall(r"`(\w+)`", text)}
        assert named and named <= defined, (path, named - defined)


def test_the_cli_imports_no_mlx_before_a_command_runs():
    """Every command loads Debian's OpenBLAS before its first `import mlx` (MLX's own
    reference BLAS is ~40x slower, and loading OpenBLAS after MLX changes nothing). Building
    the parser imports every bench module, so none of them may import MLX at its top: one
    that did made `bench turn`'s in-process floor 10x slower (2.4 s against 0.25 s)."""
    import subprocess
    import sys

    code = ("import sys; from kvbank.apps.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
