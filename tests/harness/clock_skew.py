"""Shift this process's wall clock for a test: ``time.time`` and, optionally, the clock botocore signs
S3 requests with.

libfaketime shifts a whole process from outside; where it is not installed (as here) the same effect for
ckptd's own decisions comes from wrapping :func:`time.time` inside the process under test: every ckptd
module reads the wall clock through it (``time.time()``), and the monotonic clock is left alone, as a
real clock step leaves it. ``signing=True`` also shifts :func:`botocore.auth.get_current_datetime`, so the
requests this process sends carry the skewed ``X-Amz-Date`` a skewed machine would send (S3 refuses them
past 15 minutes: :class:`ckptd.testing.fault_proxy.FaultProxy` with ``check_skew=True`` does what AWS
does). The object store (moto's server) runs in its own process and keeps the true clock. Threads of this
process that read ``time.time`` see the shift too (an in-process proxy among them).

Usage::

    with skewed_clock(+20 * 60):
        collect_garbage(tier)          # a collector whose clock runs 20 minutes ahead
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator


@contextlib.contextmanager
def skewed_clock(offset_s: float, *, wall: bool = True, signing: bool = False) -> Iterator[None]:
    """Within the block, ``time.time()`` (``wall``) and botocore's signing clock (``signing``) run
    ``offset_s`` seconds off the true clock."""
    real_time = time.time
    saved_signing = None
    if wall:
        time.time = lambda: real_time() + offset_s  # type: ignore[assignment]
    if signing:
        from botocore import auth

        saved_signing = auth.get_current_datetime
        auth.get_current_datetime = lambda *args, **kwargs: (  # type: ignore[assignment]
            saved_signing(*args, **kwargs) + datetime.timedelta(seconds=offset_s))
    try:
        yield
    finally:
        time.time = real_time  # type: ignore[assignment]
        if saved_signing is not None:
            from botocore import auth

            auth.get_current_datetime = saved_signing  # type: ignore[assignment]


__all__ = ["skewed_clock"]
