"""The logic behind ``ckptd bench`` (see :mod:`ckptd.bench.runner`); the command is in ckptd.cli."""
