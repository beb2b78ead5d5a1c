"""A step's files on a tier: writing one rank's data files and index, reading and verifying chunks.

Sits above :mod:`ckptd.tiers` (it writes and reads through them) and below the manager, DCP plugins and
promotion, which all read and write steps through it.
"""
