"""transformers' import scan, kept on disk.

transformers 5 builds its lazy module table at every import by reading each of its ~3,400
model files (`define_import_structure`): 0.7 s of the 1.5 CPU-s a router spends to start, and
as much in every worker (mlx-lm imports transformers). The table is a function of the
installed files, so kvbank keeps it in its cache folder, one JSON file per transformers version,
path and folder change, and hands it back at the next start.

`install()` runs first in each kvbank process (`kvbank.apps.cli.main`). It wraps the function
as its module loads, before `transformers/__init__` calls it. A transformers without the
function, or a table that does not read back, takes transformers' own path: the cache can
make a start faster and nothing else."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
_MODULE = "transformers.utils.import_utils"


def install() -> None:
    """Wrap `define_import_structure` when transformers loads (no-op if it has loaded)."""
    if _MODULE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # once: the module loads once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        scan = getattr(module, "define_import_structure", None)
        if callable(scan):
            module.define_import_structure = _kept(scan)


def _kept(scan):
    @functools.lru_cache  # as transformers' own: a second call gets the same table
    def define_import_structure(module_path, prefix=None):
        where = _path(module_path, prefix)
        if where is not None:
            try:
                return _read(where)
            except (OSError, ValueError, TypeError, KeyError):
                pass
        table = scan(module_path, prefix)
        if where is not None:
            _write(where, table)
        return table

    define_import_structure.uncached = scan  # what tests compare the kept table with
    return define_import_structure


def _path(module_path, prefix) -> Path | None:
    """The table's file: named by transformers' version, the folder scanned and its mtime (a
    model folder added or removed changes it). None: nothing to name it by."""
    import hashlib
    import importlib.metadata as md

    from kvbank.models import default_cache_dir

    try:
        folder = Path(module_path)
        folder = folder.parent if folder.is_file() else folder
        key = f"{md.version('transformers')}|{folder}|{folder.stat().st_mtime_ns}|{prefix}"
    except (OSError, md.PackageNotFoundError):
        return None
    name = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return default_cache_dir() / "transformers-import" / f"{name}.json"


def _read(where: Path) -> dict:
    rows = json.loads(where.read_text())
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in rows}


def _write(where: Path, table: dict) -> None:
    """Atomically (several processes start at once); a failure costs the next start a scan."""
    rows = [[sorted(backends), {m: sorted(names) for m, names in modules.items()}]
            for backends, modules in table.items()]
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_name(f"{where.name}.{os.getpid()}")
        tmp.write_text(json.dumps(rows))
        os.replace(tmp, where)
    except (OSError, TypeError) as e:
        logger.debug("transformers' import table not kept: %s", e)
