"""transformers' import table kept on disk (kvbank/transformers_scan.py): a process that reads
it gets the table transformers' own scan builds, and a damaged file costs a scan, not a start.
Each check runs in a fresh interpreter: this one may have imported transformers already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CHECK = """
from kvbank import transformers_scan
transformers_scan.install()
import transformers
from pathlib import Path
import transformers.utils.import_utils as iu

kept = iu.define_import_structure
models = Path(transformers.__file__).parent / "models"
for args in ((models, "models"), (str(models / "__init__.py"), None)):
    # transformers' __init__ adds to the first table once it has it: a new one for each side
    kept.cache_clear()
    iu.create_import_structure_from_path.cache_clear()
    assert kept.__wrapped__(*args) == kept.uncached.__wrapped__(*args), args
assert transformers.AutoTokenizer.__name__ == "AutoTokenizer"
print("ok")
"""


def _run(cache) -> None:
    env = {"KVBANK_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_kept_table_equals_transformers_own_scan(tmp_path):
    _run(tmp_path)  # writes the tables
    kept = sorted((tmp_path / "transformers-import").glob("*.json"))
    assert len(kept) >= 2, kept
    _run(tmp_path)  # reads them back, and compares each with a scan


def test_a_damaged_table_costs_a_scan_and_is_written_again(tmp_path):
    _run(tmp_path)
    kept = sorted((tmp_path / "transformers-import").glob("*.json"))
    damage = ["not json", "[[1, 2]]", ""]  # not JSON, not a table, cut to nothing
    for i, f in enumerate(kept):
        f.write_text(damage[i % 3])
    _run(tmp_path)
    for i, f in enumerate(kept):
        assert isinstance(json.loads(f.read_text()), list) and f.read_text() != damage[i % 3]
