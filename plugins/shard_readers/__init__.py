"""Shard-format readers, registered under the ``ckptd.shard_readers`` entry-point group."""
