"""``python -m harness.slow_daemon daemon ...``: the real ``ckptd`` CLI whose copies to remote tiers are slow.

Each ``write_bytes`` of the object tier (and ``write_stream`` of the peer tier, which its ``write_bytes``
calls) first prints
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


def _slow(tier_class: type, method: str, delay_s: float) -> None:
    original = getattr(tier_class, method)

    def write(self: Any, path: str, *arguments: Any, **options: Any) -> None:
        with _print_lock:
            sys.stdout.write(f"write {self.kind} {path}\n")
            sys.stdout.flush()
        time.sleep(delay_s)
        original(self, path, *arguments, **options)

    setattr(tier_class, method, write)


def main() -> None:
    delay_s = float(os.environ.get("CKPTD_TEST_SLOW_WRITES_S", "0.05"))
    from ckptd.tiers.object import ObjectTier

    _slow(ObjectTier, "write_bytes", delay_s)
    try:
        from ckptd.tiers.peer import PeerTier
    except ImportError:
        pass
    else:
        _slow(PeerTier, "write_stream", delay_s)  # its write_bytes calls write_stream
    from ckptd.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
