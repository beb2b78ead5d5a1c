"""The wire layout of the peer tier: namespaces and the paths of files inside them, in both directions.

A daemon serves a node's checkpoints under ``/v1/peer/<namespace>/...``. A namespace is
``roots/<root name>`` (a local root of that node, read only) or ``replicas/<node id>/<root name>``
(what a buddy replicated to it). Inside a namespace a request names one of:

================================  =========================================================
``steps``                         the list of steps
``step-<12 digits>``              the list of a step's files (DELETE: remove the step directory)
``step-<12 digits>/<file name>``  a file of a step
``chunks/<dir>/<file name>``      a content-addressed chunk (replica namespaces only)
================================  =========================================================

The client (:mod:`ckptd.tiers.peer`) builds request paths with :func:`request_path`; the server
(:mod:`ckptd.daemon.peer_api`) parses them with :func:`parse_request_path`, which percent-decodes each
segment exactly once and then accepts only the forms above: every segment is a safe name (letters,
digits, ``.``, ``_``, ``-``, not starting with a dot, no ``..``, at most 200 characters), so a decoded
``/``, ``\\``, NUL, ``..`` or an absolute path never gets through, and neither do temporary file names.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from ckptd.errors import UnsafePathError
from ckptd.format.layout import TEMP_MARKER, parse_step_dir, safe_name, step_dir

#: Where the peer endpoints live on a daemon's HTTP server.
PEER_PREFIX = "/v1/peer/"
#: Namespace kinds and how many names follow the kind.
NAMESPACE_KINDS = {"roots": 1, "replicas": 2}
#: The request naming the list of steps of a namespace.
STEPS_LISTING = "steps"
#: The directory of content-addressed chunks inside a namespace.
CHUNKS_DIRECTORY = "chunks"


@dataclass(frozen=True)
class PeerPath:
    """One parsed request: its namespace and what inside it is asked for.

    ``kind`` is ``"steps"`` (the listing of steps), ``"step"`` (a step directory: its listing) or
    ``"file"`` (``relative`` is then the file's path relative to the namespace root, as a tier names it)."""

    namespace: tuple[str, ...]
    kind: str
    step: int | None = None
    relative: str | None = None

    @property
    def namespace_name(self) -> str:
        return "/".join(self.namespace)


def _refuse(why: str, shown: str) -> UnsafePathError:
    return UnsafePathError(f"refusing peer path {shown!r}: {why}",
                           hint="name steps, step-<12 digits>[/<file>] or chunks/<dir>/<file> inside "
                                "roots/<root> or replicas/<node>/<root>")


def _segment(text: str, shown: str) -> str:
    """``text`` if it is a safe name (:func:`ckptd.format.layout.safe_name`, the rule of names in an index)."""
    try:
        return safe_name(text)
    except UnsafePathError:
        raise _refuse(f"segment {text[:80]!r} is not a safe name", shown) from None


def split_namespace(segments: list[str], shown: str) -> tuple[tuple[str, ...], list[str]]:
    """The namespace at the start of decoded ``segments`` and the segments after it."""
    if not segments or segments[0] not in NAMESPACE_KINDS:
        raise _refuse(f"the namespace must start with one of {sorted(NAMESPACE_KINDS)}", shown)
    count = 1 + NAMESPACE_KINDS[segments[0]]
    if len(segments) < count:
        raise _refuse("the namespace is incomplete", shown)
    return tuple(_segment(part, shown) for part in segments[:count]), segments[count:]


def parse_namespace(text: str) -> tuple[str, ...]:
    """A namespace written as ``roots/<root>`` or ``replicas/<node>/<root>``; raises UnsafePathError."""
    namespace, rest = split_namespace(text.strip("/").split("/"), text)
    if rest:
        raise _refuse("a namespace has nothing after its names", text)
    return namespace


def parse_relative(segments: list[str], namespace: tuple[str, ...], shown: str) -> PeerPath:
    """What the decoded ``segments`` after a namespace ask for (see the module docstring)."""
    if segments == [STEPS_LISTING]:
        return PeerPath(namespace, "steps")
    if len(segments) in (1, 2) and segments[0].startswith("step-"):
        step = parse_step_dir(segments[0])
        if step is None:
            raise _refuse("a step directory is step-<12 digits>", shown)
        if len(segments) == 1:
            return PeerPath(namespace, "step", step=step)
        return PeerPath(namespace, "file", step=step, relative=f"{step_dir(step)}/{_file_name(segments[1], shown)}")
    if len(segments) == 3 and segments[0] == CHUNKS_DIRECTORY:
        directory, name = _segment(segments[1], shown), _file_name(segments[2], shown)
        return PeerPath(namespace, "file", relative=f"{CHUNKS_DIRECTORY}/{directory}/{name}")
    raise _refuse("not a listing, a step file or a chunk", shown)


def _file_name(text: str, shown: str) -> str:
    if TEMP_MARKER in text:
        raise _refuse("temporary files are never served", shown)
    return _segment(text, shown)


def parse_request_path(raw_path: str) -> PeerPath:
    """Parse the raw (still percent-encoded) path of a request under :data:`PEER_PREFIX`.

    Each segment is decoded exactly once, then checked; nothing that could name a file outside the
    namespace is accepted. Raises UnsafePathError."""
    shown = raw_path[:200]
    if not raw_path.startswith(PEER_PREFIX):
        raise _refuse(f"peer paths start with {PEER_PREFIX}", shown)
    segments = []
    for raw in raw_path[len(PEER_PREFIX):].split("/"):
        try:
            segments.append(urllib.parse.unquote(raw, errors="strict"))
        except UnicodeDecodeError:
            raise _refuse("a segment is not valid UTF-8 once decoded", shown) from None
    namespace, rest = split_namespace(segments, shown)
    return parse_relative(rest, namespace, shown)


def request_path(namespace: tuple[str, ...], relative: str, *, kind: str) -> str:
    """The encoded request path of ``relative`` in a namespace, which must be of ``kind`` (``"file"``: a
    tier path; ``"steps"``; ``"step"``: a step directory); raises UnsafePathError for any other path."""
    segments = [*namespace, *relative.split("/")]
    shown = "/".join(segments)
    split_namespace(segments, shown)
    if parse_relative(segments[len(namespace):], namespace, shown).kind != kind:
        raise _refuse(f"not a {kind}", shown)
    return PEER_PREFIX + "/".join(urllib.parse.quote(segment, safe="") for segment in segments)


__all__ = ["CHUNKS_DIRECTORY", "NAMESPACE_KINDS", "PEER_PREFIX", "PeerPath", "STEPS_LISTING", "parse_namespace",
           "parse_relative", "parse_request_path", "request_path", "split_namespace"]
