"""A small public kit for testing code that uses ckptd (real processes, real tiers, no mocks).

- :mod:`ckptd.testing.multirank`: run a function on N real gloo processes, with deadlines and the remote
  exceptions re-raised;
- :mod:`ckptd.testing.tier_conformance`: the suite every storage tier must pass (a third-party tier too);
- :mod:`ckptd.testing.fault_proxy`: an HTTP proxy that injects faults between a client and a real S3 server;
- :mod:`ckptd.testing.tamper`: damage a committed step on purpose (flip a bit, drop a file);
- :mod:`ckptd.testing.compare`: compare two states bit for bit, naming what differs.

This repository's own harness (the jobs its tests launch, crash injection, the fault matrix) is not shipped.
"""

from ckptd.testing.multirank import free_port, run_multirank

__all__ = ["free_port", "run_multirank"]
