"""Turning a training state into tensors plus a JSON skeleton, and loading it back in place.

A state is a mapping whose values are tensors, numpy arrays, nested dicts/lists/tuples, JSON scalars,
``bytes``, or objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers,
ckptd's data loader, torchdata's ``StatefulDataLoader``). A plain torch ``DataLoader`` keeps no position: it
is saved as a marker, with a warning naming it and the fix (:mod:`ckptd.state.loaders`). :func:`flatten` walks it once and returns every tensor under a readable path
name plus a JSON *skeleton* that records the structure. Nothing is pickled unless the caller passes
``allow_pickle=True``; then values of any other type are pickled, and loading them again needs the
same opt-in.

Plain values (JSON scalars, bytes, numpy scalars, and the dicts and lists holding them) are snapshots:
their JSON goes into the skeleton when the state is saved, so what a step holds is the value in the
state at that ``save()``. A counter kept in a local variable and put into the state once, before the
loop, is saved with its first value: update the state entry before each save, or keep such values in
an object with ``state_dict()``/``load_state_dict()``, which is asked for its state at every save.

:func:`load_into` walks a skeleton against the live state and loads in place: tensors are copied into
existing tensors of the same shape, dicts and lists are updated in place, and objects with
``load_state_dict`` receive their rebuilt state dict. Tensors that were views of one storage are saved
as separate values and restored as equal values (views in the live state stay views, because the copy
goes into their shared memory).
"""

from __future__ import annotations

import base64
import collections
import io
import pickle
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptd.errors import CkptdError, FormatError, PickleRefusedError, ResumeMismatchError
from ckptd.format.records import DTYPE_NAMES, DTYPES
from ckptd.state.loaders import describe_loader, is_unresumable_loader, warn_unresumable_loader

#: Reads the tensor saved under a name, into ``out`` when given (same shape and dtype), else fresh.
TensorSource = Callable[[str, "torch.Tensor | None"], torch.Tensor]

_JSON_SCALARS = (str, int, float, bool, type(None))
#: Skeleton entries decoded from the skeleton alone (plus, for arrays, one stored tensor).
_LEAF_KINDS = frozenset({"ndarray", "np_scalar", "bytes", "dtype", "size", "device"})


@dataclass
class FlatState:
    """A state taken apart: its tensors by path name, and the JSON skeleton that rebuilds it."""

    skeleton: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _escape(key: Any) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


class _Flattener:
    def __init__(self, allow_pickle: bool, step: int | None = None, loader_markers: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.step = step
        self.loader_markers = loader_markers
        self.tensors: dict[str, torch.Tensor] = {}

    def _name(self, path: str) -> str:
        name, suffix = path or "_", 1
        while name in self.tensors:
            suffix += 1
            name = f"{path}#{suffix}"
        return name

    def node(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_sparse or value.is_quantized or value.dtype not in DTYPE_NAMES:
                return self._pickle(value, path, "sparse, quantized or exotic tensors")
            name = self._name(path)
            self.tensors[name] = value.detach()
            return {"tensor": name}
        if isinstance(value, np.ndarray) and value.dtype != np.dtype(object):
            name = self._name(path)
            contiguous = np.ascontiguousarray(value)
            raw = contiguous.reshape(-1).view(np.uint8)
            # no copy here: saving stages every tensor into its own buffer before it returns
            self.tensors[name] = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
            # the shape of ``value``: np.ascontiguousarray turns a 0-d array into a 1-d one
            return {"ndarray": name, "dtype": contiguous.dtype.str, "shape": list(value.shape)}
        if isinstance(value, np.generic) and not isinstance(value, np.object_):
            return {"np_scalar": base64.b64encode(value.tobytes()).decode(), "dtype": value.dtype.str}
        if isinstance(value, bool) or isinstance(value, _JSON_SCALARS):
            return {"value": value}
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": base64.b64encode(value).decode()}
        if isinstance(value, torch.dtype):
            return {"dtype": DTYPE_NAMES.get(value) or str(value)}
        if isinstance(value, torch.Size):
            return {"size": list(value)}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, Mapping):
            items = []
            for key, child in value.items():
                if not isinstance(key, _JSON_SCALARS):
                    return self._pickle(value, path, f"a dict key of type {type(key).__name__}")
                items.append([key, self.node(child, f"{path}/{_escape(key)}" if path else _escape(key))])
            return {"dict": items, "ordered": isinstance(value, collections.OrderedDict)}
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.node(child, f"{path}/{i}") for i, child in enumerate(value)]}
        if self.loader_markers and is_unresumable_loader(value):
            warn_unresumable_loader(value, path)
            return {"unsaved_loader": describe_loader(value)}
        if _has_state_dict(value):
            return {"stateful": self.node(_saved_state(value, self.step), path)}
        return self._pickle(value, path, f"a value of type {type(value).__name__}")

    def _pickle(self, value: Any, path: str, what: str) -> Any:
        if not self.allow_pickle:
            raise PickleRefusedError(
                f"state entry {path!r} is {what}, which ckptd can only save with pickle",
                hint="convert it to tensors/JSON values, give it state_dict()/load_state_dict(), or pass "
                     "allow_pickle=True (restoring it will need allow_pickle=True too)")
        buffer = io.BytesIO()
        torch.save(value, buffer) if isinstance(value, torch.Tensor) else pickle.dump(value, buffer)
        name = self._name(path)
        self.tensors[name] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        return {"pickle": name, "torch": isinstance(value, torch.Tensor)}


def _saved_state(value: Any, step: int | None) -> Any:
    """An object's state for a save of ``step``: ``value.state_dict_for_step(step)`` when the object has
    that method and the step is known (ckptd's ShardLoader saves the position the steps after ``step``
    start from), else ``value.state_dict()``."""
    for_step = getattr(value, "state_dict_for_step", None)
    if step is not None and callable(for_step):
        return for_step(step)
    return value.state_dict()


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False, step: int | None = None,
            loader_markers: bool = True) -> FlatState:
    """Take a state apart into tensors and a JSON skeleton. Raises PickleRefusedError on values that
    need pickle when ``allow_pickle`` is False. ``step``: the step being saved, handed to objects with
    ``state_dict_for_step(step)`` (None: every object's ``state_dict()``). ``loader_markers``: a plain
    DataLoader becomes a marker that a restore into the live state leaves alone (False: it is a value that
    needs pickle, for callers that rebuild values instead of loading in place, such as DCP)."""
    flattener = _Flattener(allow_pickle, step, loader_markers)
    skeleton = flattener.node(state, "")
    return FlatState(skeleton=skeleton, tensors=flattener.tensors)


def skeleton_tensor_names(skeleton: Any) -> list[str]:
    """Every tensor name a skeleton refers to, in walk order."""
    names: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in ("tensor", "ndarray", "pickle"):
                if key in node:
                    names.append(node[key])
                    return
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(skeleton)
    return names


def no_pending_reads(*, raise_errors: bool = True) -> None:
    """The ``settle`` of a tensor source whose reads are complete when they return."""


class _Loader:
    def __init__(self, read: TensorSource, allow_pickle: bool, settle: Callable[..., None] = no_pending_reads) -> None:
        self.read = read
        self.allow_pickle = allow_pickle
        self.settle = settle

    def node(self, node: Any, target: Any, path: str) -> Any:
        if not isinstance(node, dict) or not node:
            raise CkptdError(f"malformed state skeleton at {path!r}")
        kind = next(iter(node))
        if kind == "unsaved_loader":  # a plain DataLoader: nothing was saved, the live loader stays as it is
            return target
        if kind != "stateful" and _has_state_dict(target):  # replacing the object would drop it silently
            raise ResumeMismatchError(
                f"the live state has an object with load_state_dict() ({type(target).__name__}) under key "
                f"{path!r}, but the checkpoint holds a plain {kind} there",
                hint="pass the state as it was saved, or restore the other keys with restore(state, keys=[...])")
        if kind == "tensor":
            return self._tensor(node["tensor"], target, path)
        if kind == "value":
            return node["value"]
        if kind == "dict":
            return self._dict(node, target, path)
        if kind in ("list", "tuple"):
            return self._sequence(node[kind], kind, target, path)
        if kind == "stateful":
            if target is None:
                raise ResumeMismatchError(
                    f"the checkpoint holds an object's state (saved through state_dict()) under key {path!r}, "
                    "but the live state has no value there",
                    hint=f"build the object and put it under {path!r} before restoring, or restore the other "
                         "keys with restore(state, keys=[...])")
            if not _has_state_dict(target):
                raise ResumeMismatchError(
                    f"the checkpoint holds an object's state (saved through state_dict()) under key {path!r}, "
                    f"but the live state has a {type(target).__name__} there",
                    hint="pass the same kind of object as when saving")
            rebuilt = self.node(node["stateful"], target.state_dict(), path)
            self.settle()  # the object may copy or cast the tensors it receives
            target.load_state_dict(rebuilt)
            return target
        if kind in _LEAF_KINDS:
            try:
                return self._leaf(kind, node, target)
            except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
                raise _malformed(path, str(exc)) from exc
        if kind == "pickle":
            return self._unpickle(node, path)
        raise CkptdError(f"unknown entry kind {kind!r} in the state skeleton at {path!r}",
                         hint="this checkpoint was written by a newer ckptd; upgrade ckptd")

    def _leaf(self, kind: str, node: dict[str, Any], target: Any) -> Any:
        """Decode a leaf entry; a malformed one raises TypeError/ValueError/KeyError."""
        if kind in ("ndarray", "np_scalar"):
            dtype = np.dtype(node["dtype"])
            if dtype.hasobject:  # object arrays exist only through pickle; ckptd never writes these
                raise ValueError(f"numpy dtype {dtype} holds Python objects")
        if kind == "ndarray":
            raw = self.read(node["ndarray"], None)
            self.settle()  # the array is used right away: its bytes must have arrived
            array = raw.numpy().view(dtype).reshape([int(dim) for dim in node["shape"]])
            if isinstance(target, np.ndarray) and target.shape == array.shape and target.dtype == dtype \
                    and target.flags.writeable:
                target[...] = array
                return target
            return array
        if kind == "np_scalar":
            return np.frombuffer(base64.b64decode(node["np_scalar"], validate=True), dtype=dtype)[0]
        if kind == "bytes":
            return base64.b64decode(node["bytes"], validate=True)
        if kind == "dtype":
            name = node["dtype"]
            found = DTYPES.get(name) or getattr(torch, str(name).removeprefix("torch."), None)
            if not isinstance(found, torch.dtype):  # never hand out other attributes of torch
                raise ValueError(f"{name!r} is not a torch dtype")
            return found
        if kind == "size":
            return torch.Size(node["size"])
        return torch.device(node["device"])

    def _tensor(self, name: str, target: Any, path: str) -> torch.Tensor:
        if isinstance(target, torch.Tensor):
            return self.read(name, target)
        return self.read(name, None)

    def _dict(self, node: dict[str, Any], target: Any, path: str) -> Any:
        items = node["dict"]
        if not isinstance(items, list) or not all(isinstance(item, list) and len(item) == 2
                                                  and isinstance(item[0], _JSON_SCALARS) for item in items):
            raise _malformed(path, "a dict entry is not a [key, value] pair with a JSON scalar key")
        if isinstance(target, MutableMapping):
            for key, child in node["dict"]:
                if key not in target and isinstance(child, dict) and "unsaved_loader" in child:
                    continue  # nothing was saved for that loader: the live state gets no entry for it
                target[key] = self.node(child, target.get(key), _child_path(path, key))
            return target
        rebuilt: dict[Any, Any] = collections.OrderedDict() if node.get("ordered") else {}
        for key, child in node["dict"]:
            rebuilt[key] = self.node(child, None, _child_path(path, key))
        return rebuilt

    def _sequence(self, children: list[Any], kind: str, target: Any, path: str) -> Any:
        if not isinstance(children, list):
            raise _malformed(path, f"a {kind} entry is not a JSON list")
        same_shape = isinstance(target, (list, tuple)) and len(target) == len(children)
        values = [self.node(child, target[i] if same_shape else None, _child_path(path, i))
                  for i, child in enumerate(children)]
        if kind == "list" and isinstance(target, list) and same_shape:
            target[:] = values
            return target
        return values if kind == "list" else tuple(values)

    def _unpickle(self, node: dict[str, Any], path: str) -> Any:
        if not self.allow_pickle:
            raise PickleRefusedError(
                f"state entry {path!r} was saved with pickle; ckptd does not unpickle by default",
                hint="pass allow_pickle=True only if you trust this checkpoint")
        raw = self.read(node["pickle"], None)
        self.settle()
        data = bytes(raw.numpy())
        if node.get("torch"):
            return torch.load(io.BytesIO(data), weights_only=False)
        return pickle.loads(data)


def _child_path(path: str, key: Any) -> str:
    """The path of a state entry as errors name it: keys joined by ``/`` (``model``, ``optim/state/0``)."""
    return f"{path}/{key}" if path else str(key)


def _malformed(path: str, why: str) -> FormatError:
    return FormatError(f"malformed state skeleton at {path!r}: {why}",
                       hint="the index was tampered with or is corrupt; restore an older step")


def load_into(state: MutableMapping[str, Any], skeleton: Any, read: TensorSource, *,
              allow_pickle: bool = False, settle: Callable[..., None] = no_pending_reads) -> None:
    """Load a saved skeleton into the live ``state`` in place (see the module docstring).

    ``read`` may return a tensor (live, or allocated for a value the live state lacks) whose bytes are
    still arriving; ``settle()`` then waits for them and raises a failed read. It is called before any
    object's ``load_state_dict``, before an array or a pickled value is decoded, and at the end; on a
    failure ``settle(raise_errors=False)`` runs before the failure propagates."""
    if not isinstance(skeleton, dict) or "dict" not in skeleton:
        raise CkptdError("the state skeleton is not a mapping")
    try:
        _Loader(read, allow_pickle, settle).node(skeleton, state, "")
    except BaseException:
        settle(raise_errors=False)
        raise
    settle()


def rebuild(skeleton: Any, read: TensorSource, *, allow_pickle: bool = False) -> Any:
    """Rebuild a saved state as plain Python values (stateful objects become their state dicts)."""

    class _Detached(_Loader):
        def node(self, node: Any, target: Any, path: str) -> Any:
            if isinstance(node, dict) and "stateful" in node:
                return super().node(node["stateful"], None, path)
            return super().node(node, None, path)

    return _Detached(read, allow_pickle).node(skeleton, None, "")
