"""Reading a saved state's skeleton without its tensors: which keys a step holds, and its plain values.

A step's state skeleton (:mod:`ckptd.state.tree`) holds every non-tensor value itself (step counters,
a loader's position, a config dict, learning rates) and only names the tensors. This module works on
the skeleton alone, so it reads no tensor and needs no torch:

- :func:`saved_keys` lists the top-level keys of the saved state, :func:`stateful_keys` those saved
  through an object's ``state_dict()``;
- :func:`select_keys` keeps only some of them (a partial restore loads that skeleton, and so reads
  only the tensors those keys refer to);
- :func:`saved_values` lists every plain value with its path, for ``ckptd inspect``.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ckptd.errors import FormatError

@dataclass(frozen=True)
class SavedValue:
    """One plain value of a saved state: its path (keys joined by ``/``) and its value as JSON.

    A list or tuple of plain values is one entry holding the list; an array is described by its dtype
    and shape (``"<ndarray int64 [3]>"``), bytes by their length, a pickled value as ``"<pickled>"``."""

    path: str
    value: Any


def _root_items(skeleton: Any) -> list[list[Any]]:
    if not isinstance(skeleton, dict) or not isinstance(skeleton.get("dict"), list):
        raise FormatError("the state skeleton is not a mapping",
                          hint="the index was tampered with or is corrupt; restore an older step")
    return skeleton["dict"]


def saved_keys(skeleton: Any) -> list[Any]:
    """The top-level keys of a saved state, in the order they were saved."""
    return [item[0] for item in _root_items(skeleton) if isinstance(item, list) and len(item) == 2]


def stateful_keys(skeleton: Any) -> list[Any]:
    """The top-level keys whose saved value is an object's ``state_dict()`` (a model, an optimizer, a loader)."""
    return [item[0] for item in _root_items(skeleton) if isinstance(item, list) and len(item) == 2
            and isinstance(item[1], dict) and next(iter(item[1]), None) == "stateful"]


def select_keys(skeleton: Any, keys: Iterable[Any]) -> tuple[Any, list[Any]]:
    """The skeleton holding only ``keys`` (in saved order), and the keys it lacks (in the order asked)."""
    wanted = list(keys)
    items = [item for item in _root_items(skeleton) if isinstance(item, list) and len(item) == 2]
    present = {item[0] for item in items}
    kept = {key: None for key in wanted}
    subset = {**skeleton, "dict": [item for item in items if item[0] in kept]}
    return subset, [key for key in wanted if key not in present]


def saved_values(skeleton: Any) -> list[SavedValue]:
    """Every plain (non-tensor) value of a saved state, in walk order, with its path."""
    return list(_walk(skeleton, ""))


#: What :func:`_plain` returns for a node that is not a plain value.
_NOT_PLAIN = object()


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _walk(node: Any, path: str) -> Iterator[SavedValue]:
    if not isinstance(node, dict) or not node:
        raise FormatError(f"malformed state skeleton at {path!r}")
    kind = next(iter(node))
    if kind == "tensor":
        return  # listed with the tensors
    if kind == "stateful":
        yield from _walk(node["stateful"], path)
    elif kind == "dict":
        for item in node["dict"]:
            if isinstance(item, list) and len(item) == 2:
                yield from _walk(item[1], _join(path, item[0]))
    elif kind in ("list", "tuple"):
        children = node[kind] if isinstance(node[kind], list) else []
        plain = [_plain(child) for child in children]
        if all(value is not _NOT_PLAIN for value in plain):
            yield SavedValue(path, plain)
        else:
            for i, child in enumerate(children):
                yield from _walk(child, _join(path, i))
    else:
        value = _plain(node)
        yield SavedValue(path, f"<{kind}>" if value is _NOT_PLAIN else value)


def _plain(node: Any) -> Any:
    """The JSON form of a leaf node, or ``_NOT_PLAIN`` for a container or a tensor."""
    if not isinstance(node, dict) or not node:
        return _NOT_PLAIN
    kind = next(iter(node))
    if kind == "value":
        return node["value"]
    if kind == "np_scalar":
        return _np_scalar(node)
    if kind == "bytes":
        return f"<{len(base64.b64decode(node['bytes']))} bytes>"
    if kind == "dtype":
        return str(node["dtype"])
    if kind == "size":
        return list(node["size"])
    if kind == "device":
        return str(node["device"])
    if kind == "ndarray":
        return f"<ndarray {node.get('dtype')} {list(node.get('shape', []))}>"
    if kind == "pickle":
        return "<pickled>"
    if kind == "unsaved_loader":
        return f"<not saved: {node['unsaved_loader']}>"
    return _NOT_PLAIN


def _np_scalar(node: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(node["dtype"])
    if dtype.hasobject:
        return "<np_scalar>"
    return np.frombuffer(base64.b64decode(node["np_scalar"], validate=True), dtype=dtype)[0].item()
