"""TESTING ONLY: a coldstore on a slow disk, a stand-in for a throttled disk (something outside
the project). The real coldstore process, each block commit delayed by `--delay-s`.

    python -m tests.slow_coldstore --delay-s 0.8 --data-dir DIR [any `kvbank coldstore` flag]
    python -m tests.slow_coldstore --delay-s 0.8 up [any `kvbank up` flag]

Every other flag is `kvbank coldstore`'s (or `kvbank up`'s), parsed by the real command, so this
stands in for it wherever a test starts a coldstore; in `up`, the supervisor starts this module
in place of its coldstore child.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvbank.coldstore import server
from kvbank.coldstore.store import ColdStore


class FakeSlowDiskStore:
    """The real store, each block commit delayed by `delay_s`."""

    def __init__(self, store: ColdStore, delay_s: float):
        self._store, self._delay_s = store, delay_s

    def commit_block(self, *args, **kw):
        time.sleep(self._delay_s)
        return self._store.commit_block(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._store, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.slow_coldstore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-s", type=float, required=True,
                    help="sleep this long before each block commit")
    ours, rest = ap.parse_known_args(argv)
    if rest[:1] == ["up"]:
        return _up(ours.delay_s, rest[1:])
    start = server.start

    def slow_start(*args, **kw) -> server.ColdstoreServer:
        cs = start(*args, **kw)
        cs.store = FakeSlowDiskStore(cs.store, ours.delay_s)
        return cs

    server.start = slow_start  # what `kvbank coldstore` (kvbank.coldstore.server.main) starts
    from kvbank.apps.cli import main as kvbank

    return kvbank(["coldstore", *rest])


def _up(delay_s: float, flags: list[str]) -> int:
    """`kvbank up`, its coldstore child on the slow disk."""
    from kvbank.deploy import supervisor

    real_init = supervisor.Supervisor.__init__

    def init(self, *args, **kw) -> None:
        real_init(self, *args, **kw)
        (child,) = [c for c in self.children if c.name == "coldstore"]
        i = child.argv.index("coldstore")
        child.argv = [sys.executable, "-m", "tests.slow_coldstore", "--delay-s", str(delay_s),
                      *child.argv[i + 1:]]

    supervisor.Supervisor.__init__ = init
    from kvbank.apps.cli import main as kvbank

    return kvbank(["up", *flags])


if __name__ == "__main__":
    sys.exit(main())
