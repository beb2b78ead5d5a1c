"""``python -m ckptd.testing.slow_daemon daemon ...``: the real ``ckptd`` CLI whose copies to remote tiers are slow.

Each ``write_bytes`` of the object tier (and of the peer tier, where it exists) first prints
``write <tier kind> <path>`` on stdout and then sleeps ``CKPTD_TEST_SLOW_WRITES_S`` seconds, and then writes
for real. A test reads those lines and SIGKILLs the daemon while a promotion or a replication is half done:
nothing is faked, the wrapped tiers are the real ones.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

_print_lock = threading.Lock()


def _slow(tier_class: type, delay_s: float) -> None:
    original = tier_class.write_bytes

    def write_bytes(self: Any, path: str, data: Any, **options: Any) -> None:
        with _print_lock:
            sys.stdout.write(f"write {self.kind} {path}\n")
            sys.stdout.flush()
        time.sleep(delay_s)
        original(self, path, data, **options)

    tier_class.write_bytes = write_bytes  # type: ignore[method-assign]


def main() -> None:
    delay_s = float(os.environ.get("CKPTD_TEST_SLOW_WRITES_S", "0.05"))
    from ckptd.tiers.object import ObjectTier

    _slow(ObjectTier, delay_s)
    try:
        from ckptd.tiers.peer import PeerTier
    except ImportError:
        pass
    else:
        _slow(PeerTier, delay_s)
    from ckptd.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
