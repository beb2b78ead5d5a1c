"""Integrations that sit on ckptd's public API only, importable as ``ckptd.plugins``."""
