"""Test helpers shipped with ckptd, one module per concern (real processes, real tiers, no mocks).

:mod:`ckptd.testing.multirank` runs a function on N real gloo processes with deadlines and re-raised
remote exceptions; the other modules (crash injection, tampering, tier conformance, fault proxies) are
imported by name.
"""

from ckptd.testing.multirank import free_port, run_multirank

__all__ = ["free_port", "run_multirank"]
