"""Where each rank's stdout and stderr go: torchrun's ``--log-dir``, ``--redirects``, ``--tee`` and
``--local-ranks-filter``, with torchrun's file layout and console prefixes.

Layout (as torchrun's default logs spec): ``<log-dir>/<run-id>_<random>/attempt_<N>/<local rank>/stdout.log``,
``stderr.log``, and ``error.json`` (``TORCHELASTIC_ERROR_FILE``). ``N`` is the ranks'
``TORCHELASTIC_RESTART_COUNT`` of a whole-group restart: each attempt of a script that does not use
:func:`ckptd.elastic.run` gets a fresh attempt directory, as under torchrun. A rank restarted alone (a
ckptd-aware job) stays in its attempt: its new process, or the warm spare that takes its place, appends to
the rank's files. ``--redirects`` sends a stream to its file only; ``--tee`` to its file and to the console,
each line prefixed (``[<role><local rank>]:``, or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` with
``${role_name}``, ``${rank}``, ``${local_rank}``, e.g. ``[rank${rank}]:``). ``--local-ranks-filter`` shows
only the listed local ranks on the console: the others' teed streams go to their files only, and their
streams that are neither redirected nor teed are dropped. Without ``--log-dir``, redirected streams go under a
fresh temporary directory, as under torchrun.

Supervisor side: :class:`LogRouter` makes the directories and names each rank's files
(:meth:`LogRouter.variables`, passed to the rank in ``CKPTD_LOG_STDOUT``/``CKPTD_LOG_STDERR``), and copies the
teed files to the console from the supervisor's loop (:meth:`LogRouter.pump`; no thread of its own). Rank
side: :func:`redirect_from_environment` points file descriptors 1 and 2 at those files (in a forked rank, and
in a spare when it becomes a rank).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from string import Template
from typing import IO

#: The variables that carry a rank's log files (a path, or os.devnull); unset: the supervisor's stream.
ENV_STDOUT = "CKPTD_LOG_STDOUT"
ENV_STDERR = "CKPTD_LOG_STDERR"
#: torchrun's Std values: bit 1 stdout, bit 2 stderr.
OUT, ERR = 1, 2


@dataclass(frozen=True)
class LogSpec:
    """torchrun's logging options, resolved per local rank (``redirects``/``tee``: 0-3 per local rank)."""

    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    #: Local ranks shown on the console (None: all).
    local_ranks_filter: frozenset[int] | None = None
    #: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (None: ``[<role><local rank>]:``).
    prefix_template: str | None = None

    def routes(self, local_rank: int) -> int:
        """The streams of ``local_rank`` that go to files (redirected or teed)."""
        return self.redirects.get(local_rank, 0) | self.tee.get(local_rank, 0)

    @property
    def writes_files(self) -> bool:
        return any(self.routes(local) for local in set(self.redirects) | set(self.tee))

    def shown(self, local_rank: int) -> bool:
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter


@dataclass
class _Tail:
    """A teed file being copied to the console: where it was read up to, and a line not yet complete."""

    path: str
    console: IO[str]
    prefix: str
    source: IO[bytes] | None = None  # opened at the first read
    partial: bytes = b""


class LogRouter:
    """The log files of one node's ranks (see the module docstring). Supervisor thread only."""

    def __init__(self, spec: LogSpec, run_id: str, role: str, ranks: dict[int, int]) -> None:
        """``ranks``: local rank -> global rank."""
        self.spec, self.role, self.ranks = spec, role, ranks
        self.run_dir: str | None = None
        if spec.writes_files:
            root = spec.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
            os.makedirs(root, exist_ok=True)
            self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=root)
        self.attempt: int | None = None
        self._tails: dict[tuple[int, int], _Tail] = {}

    def open_attempt(self, attempt: int) -> None:
        """Make ``attempt_<attempt>`` (emptied first, as torchrun) with one folder per local rank; the teed
        files of the previous attempt are copied to the console to their end first."""
        if self.run_dir is None or attempt == self.attempt:
            return
        self.close()
        self.attempt = attempt
        folder = os.path.join(self.run_dir, f"attempt_{attempt}")
        shutil.rmtree(folder, ignore_errors=True)
        for local in self.ranks:
            os.makedirs(os.path.join(folder, str(local)))
            for stream, name in ((OUT, "stdout.log"), (ERR, "stderr.log")):
                if not self.spec.routes(local) & stream:
                    continue
                path = os.path.join(folder, str(local), name)
                open(path, "ab").close()
                if self.spec.tee.get(local, 0) & stream and self.spec.shown(local):
                    console = sys.stdout if stream == OUT else sys.stderr
                    self._tails[(local, stream)] = _Tail(path, console, self._prefix(local))

    def _prefix(self, local: int) -> str:
        if self.spec.prefix_template:
            return Template(self.spec.prefix_template).safe_substitute(role_name=self.role, rank=self.ranks[local],
                                                                       local_rank=local)
        return f"[{self.role}{local}]:"

    def folder(self, local: int) -> str | None:
        """This attempt's folder of ``local`` (None: no files are written)."""
        if self.run_dir is None or self.attempt is None:
            return None
        return os.path.join(self.run_dir, f"attempt_{self.attempt}", str(local))

    def variables(self, local: int) -> dict[str, str]:
        """The variables that send local rank ``local``'s streams where the options say (empty: both go to the
        supervisor's console as they are)."""
        found: dict[str, str] = {}
        folder = self.folder(local)
        routes = self.spec.routes(local)
        for stream, variable, name in ((OUT, ENV_STDOUT, "stdout.log"), (ERR, ENV_STDERR, "stderr.log")):
            if folder is not None and routes & stream:
                found[variable] = os.path.join(folder, name)
            elif not self.spec.shown(local):
                found[variable] = os.devnull
        if folder is not None:
            found["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, "error.json")
        return found

    def pump(self, final: bool = False) -> None:
        """Copy what the teed files gained since the last call to the console, whole lines only (everything,
        a last unfinished line included, when ``final``)."""
        for tail in self._tails.values():
            try:
                if tail.source is None:
                    tail.source = open(tail.path, "rb")  # noqa: SIM115 - closed by close()
                data = tail.source.read()
            except OSError:
                continue
            *lines, rest = (tail.partial + data).split(b"\n")
            if final and rest:
                lines, rest = [*lines, rest], b""
            tail.partial = rest
            text = "".join(f"{tail.prefix}{line.decode(errors='replace')}\n" for line in lines)
            if text:
                tail.console.write(text)
                tail.console.flush()

    def close(self) -> None:
        """Copy the rest of every teed file to the console and stop following them."""
        self.pump(final=True)
        for tail in self._tails.values():
            if tail.source is not None:
                tail.source.close()
        self._tails.clear()


def redirect_from_environment(environ: dict[str, str] | os._Environ[str]) -> None:
    """Point file descriptors 1 and 2 at the files ``environ`` names (:data:`ENV_STDOUT`, :data:`ENV_STDERR`),
    appended to: in a rank before its script runs, and in a warm spare when it becomes a rank."""
    for variable, fd, stream in ((ENV_STDOUT, 1, sys.stdout), (ENV_STDERR, 2, sys.stderr)):
        path = environ.get(variable)
        if not path:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.dup2(target, fd)
        finally:
            os.close(target)
