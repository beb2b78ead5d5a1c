"""The daemon's configuration: a TOML file, overridden by ``CKPTD_DAEMON_*`` variables, overridden by flags.

:func:`load_config` merges the three sources key by key (file < environment < flags), checks every value
and returns a frozen :class:`DaemonConfig`. Each problem is one :class:`~ckptd.errors.ConfigError` whose
message names the key and where it came from (the file, the variable or the flag) and says what to do.

Keys (TOML key ``x_y`` = flag ``--x-y`` = variable ``CKPTD_DAEMON_X_Y``) are listed in :data:`OPTIONS`;
roots are ``[[roots]]`` tables with the keys of :data:`ROOT_OPTIONS` and a ``[roots.storage_options]``
table. The flags ``--name``, ``--local``, ``--remote``, ``--s3-endpoint-url``, ``--remote-every-steps``,
``--replicate-every-steps``, ``--keep-local`` and ``--keep-remote`` (variables ``CKPTD_DAEMON_NAME``, ...)
describe a single root: with no root in the file they make one, with one they change it.

Secrets (the peer token, object-store credentials in ``storage_options``) are never part of a repr nor of
:meth:`DaemonConfig.describe`.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import re
import socket as socket_module
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptd.daemon.auth import is_loopback
from ckptd.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

log = logging.getLogger("ckptd.daemon")

#: Prefix of the variables that set daemon options.
ENV_PREFIX = "CKPTD_DAEMON_"
#: AF_UNIX path limit on Linux (``sun_path`` is 108 bytes with its terminating NUL).
MAX_SOCKET_PATH_BYTES = 107
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?")
_WATCH_MODES = ("auto", "inotify", "poll")
#: Options whose value is a secret: an error about them never shows it.
_SECRET_KEYS = frozenset({"peer_token"})
_LOG_LEVELS = ("debug", "info", "warning", "error")
_CPU_POLICIES = ("nice", "idle")
_LOCAL_DISKS = ("any", "separate")


@dataclass(frozen=True)
class _Option:
    kind: str  # str | path | int | float | uids | choice
    default: Any = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None


#: Top-level options, their kinds and defaults (None: unset, or derived from another option).
OPTIONS: dict[str, _Option] = {
    "node_id": _Option("str"),
    "state_dir": _Option("path"),
    "listen": _Option("str", "127.0.0.1:9470"),
    "socket": _Option("path"),
    "control_allowed_uids": _Option("uids"),
    "peer_token": _Option("str"),
    "peer_token_file": _Option("path"),
    "buddy": _Option("str"),
    "advertise": _Option("str"),
    "replica_dir": _Option("path"),
    "watch": _Option("choice", "auto", _WATCH_MODES),
    "poll_interval_s": _Option("float", 1.0, minimum=0.01),
    "scrub_interval_s": _Option("float", 3600.0, minimum=0.0),
    "scrub_bytes_per_s": _Option("float", 50e6, minimum=1.0),
    "drain_timeout_s": _Option("float", 30.0, minimum=0.0),
    "retry_backoff_s": _Option("float", 2.0, minimum=0.0),
    "peer_max_concurrency": _Option("int", 16, minimum=1),
    "peer_max_put_bytes": _Option("int", 64 * 1024 ** 3, minimum=1),
    "log_level": _Option("choice", "info", _LOG_LEVELS),
    "keep_peer": _Option("int", 2, minimum=1),
    "cpu_policy": _Option("choice", "nice", _CPU_POLICIES),
    "local_disk": _Option("choice", "any", _LOCAL_DISKS),
}
#: Keys of a ``[[roots]]`` table (plus the ``storage_options`` table).
ROOT_OPTIONS: dict[str, _Option] = {
    "name": _Option("str", "default"),
    "local": _Option("path"),
    "remote": _Option("str"),
    "remote_every_steps": _Option("int", minimum=1),
    "replicate_every_steps": _Option("int", minimum=1),
    "keep_local": _Option("int", minimum=1),
    "keep_remote": _Option("int", minimum=1),
}
#: Single-root flags that are not root keys, and the root setting they make.
_ROOT_FLAG_EXTRAS = {"s3_endpoint_url": _Option("str")}


@dataclass(frozen=True)
class RootConfig:
    """One watched local root: what the daemon promotes from it and where.

    ``remote_every_steps`` / ``replicate_every_steps``: which committed steps go to the object tier and to
    the buddy (None: every one). ``keep_*``: retention the daemon applies per tier (None: none).
    ``storage_options`` go to the object tier's backend and may hold credentials: never shown."""

    name: str
    local: Path
    remote: str | None = None
    remote_every_steps: int | None = None
    replicate_every_steps: int | None = None
    keep_local: int | None = None
    keep_remote: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def promotes(self, step: int) -> bool:
        """Whether ``step`` goes to this root's object tier (False when it has none)."""
        return self.remote is not None and (self.remote_every_steps is None or step % self.remote_every_steps == 0)

    def replicates(self, step: int) -> bool:
        """Whether ``step``'s cadence asks for replication (the daemon also needs a buddy)."""
        return self.replicate_every_steps is None or step % self.replicate_every_steps == 0

    def describe(self) -> str:
        parts = [f"{self.name}: {self.local}"]
        if self.remote:
            every = f" every {self.remote_every_steps}" if self.remote_every_steps else ""
            parts.append(f"-> {self.remote}{every}")
        return " ".join(parts)


@dataclass(frozen=True)
class DaemonConfig:
    """Everything one ``ckptd daemon`` runs with (see the module docstring for the keys).

    ``peer_token`` is the resolved token (from ``peer_token``, ``CKPTD_PEER_TOKEN`` or ``peer_token_file``);
    it is left out of the repr."""

    node_id: str
    state_dir: Path
    roots: tuple[RootConfig, ...]
    listen: str = "127.0.0.1:9470"
    socket: Path | None = None
    control_allowed_uids: frozenset[int] = frozenset()
    peer_token: str | None = field(default=None, repr=False)
    peer_token_file: Path | None = None
    buddy: str | None = None
    #: This node's address in a ``dns://`` buddy's ring (default: listen's host), see ckptd.daemon.buddy.
    advertise: str | None = None
    replica_dir: Path | None = None
    watch: str = "auto"
    poll_interval_s: float = 1.0
    scrub_interval_s: float = 3600.0
    scrub_bytes_per_s: float = 50e6
    drain_timeout_s: float = 30.0
    retry_backoff_s: float = 2.0
    peer_max_concurrency: int = 16
    peer_max_put_bytes: int = 64 * 1024 ** 3
    log_level: str = "info"
    keep_peer: int = 2
    #: How the copy and upkeep threads yield the CPU: "nice" (``background_nice`` + 5) or "idle" (also
    #: ``SCHED_IDLE``: they run only on CPU nothing else wants; a busy node's copies then lag).
    cpu_policy: str = "nice"
    #: "separate": refuse to start when a root's local directory is on the file system of the state dir or of
    #: ``/`` (the node's root disk: an NVMe that did not mount); "any": no check.
    local_disk: str = "any"
    source: Path | None = None

    @property
    def listen_host(self) -> str:
        return _split_host_port(self.listen, "listen", "")[0]

    @property
    def listen_port(self) -> int:
        return _split_host_port(self.listen, "listen", "")[1]

    @property
    def journal_path(self) -> Path:
        return self.state_dir / "journal.sqlite3"

    @property
    def socket_path(self) -> Path:
        return self.socket or self.state_dir / "daemon.sock"

    @property
    def replica_path(self) -> Path:
        return self.replica_dir or self.state_dir / "replicas"

    def root(self, name: str) -> RootConfig | None:
        """The root called ``name``, or None."""
        return next((root for root in self.roots if root.name == name), None)

    def peer_url(self, root: RootConfig, buddy: str | None = None) -> str | None:
        """Where ``root`` is replicated: ``<buddy>/replicas/<node_id>/<root name>``, ``buddy`` being the
        ``peer://`` URL of the buddy daemon (default: the configured one; a ``dns://`` one names none until
        :mod:`ckptd.daemon.buddy` resolves it); None without a buddy."""
        buddy = buddy or self.buddy
        if buddy is None or not buddy.startswith("peer://"):
            return None
        return f"{buddy.rstrip('/')}/replicas/{self.node_id}/{root.name}"

    def describe(self) -> str:
        """One line for ``--check-config`` and the start log (never a secret)."""
        roots = "; ".join(root.describe() for root in self.roots)
        token = "token set" if self.peer_token else "no token"
        buddy = f", buddy {self.buddy}" if self.buddy else ""
        origin = f" from {self.source}" if self.source else ""
        return (f"config ok{origin}: node {self.node_id}, {len(self.roots)} root(s) [{roots}], listen {self.listen} "
                f"({token}){buddy}, state {self.state_dir}, watch {self.watch}")


# --- loading ------------------------------------------------------------------------------------------

def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> DaemonConfig:
    """The configuration from the TOML file ``path`` (optional), the ``CKPTD_DAEMON_*`` variables of
    ``environ`` and the flag values in ``overrides`` (top-level keys, single-root keys and
    ``s3_endpoint_url``; None values are ignored), later sources winning. Creates missing directories.
    Raises ConfigError (one line naming the key and its source)."""
    environ = os.environ if environ is None else environ
    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    document = _read_file(path) if path is not None else {}
    file_label = f"file {path}" if path is not None else "config"
    top: dict[str, tuple[Any, str]] = {}
    root_tables = document.pop("roots", [])
    for key, value in document.items():
        if key not in OPTIONS:
            _unknown(key, OPTIONS, file_label)
        top[key] = (value, f"{key} in {file_label}")
    if "CKPTD_PEER_TOKEN" in environ:
        top["peer_token"] = (environ["CKPTD_PEER_TOKEN"], "CKPTD_PEER_TOKEN")
    if "CKPTD_PEER_TOKEN_FILE" in environ:
        top["peer_token_file"] = (environ["CKPTD_PEER_TOKEN_FILE"], "CKPTD_PEER_TOKEN_FILE")
    single_root: dict[str, tuple[Any, str]] = {}
    for key in OPTIONS:
        variable = ENV_PREFIX + key.upper()
        if variable in environ:
            top[key] = (environ[variable], variable)
    for key in {**ROOT_OPTIONS, **_ROOT_FLAG_EXTRAS}:
        variable = ENV_PREFIX + key.upper()
        if variable in environ:
            single_root[key] = (environ[variable], variable)
    _warn_unknown_variables(environ)
    for key, value in overrides.items():
        flag = "--" + key.replace("_", "-")
        if key in OPTIONS:
            top[key] = (value, flag)
        elif key in ROOT_OPTIONS or key in _ROOT_FLAG_EXTRAS:
            single_root[key] = (value, flag)
        else:
            _unknown(key, {**OPTIONS, **ROOT_OPTIONS}, "flags")
    values = {key: _convert(key, OPTIONS[key], *top[key]) for key in top}
    roots = _roots(root_tables, single_root, file_label)
    return _build(values, roots, {key: where for key, (_, where) in top.items()}, path)


def _warn_unknown_variables(environ: Mapping[str, str]) -> None:
    """A ``CKPTD_DAEMON_*`` variable that is no option (a typo) is warned about, not fatal: the library's own
    settings (``CKPTD_DAEMON_REQUEST_TIMEOUT_S``) share the prefix."""
    import dataclasses

    from ckptd.config import Settings

    known = {ENV_PREFIX + key.upper() for key in (*OPTIONS, *ROOT_OPTIONS, *_ROOT_FLAG_EXTRAS, "config")}
    known |= {f"CKPTD_{item.name.upper()}" for item in dataclasses.fields(Settings)}
    for variable in sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known):
        close = difflib.get_close_matches(variable, sorted(known), n=1)
        suggestion = f" (did you mean {close[0]}?)" if close else ""
        log.warning("ignoring %s: no daemon option has that name%s", variable, suggestion)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError("the daemon's config file does not exist", path=str(path),
                          hint="pass --config with an existing TOML file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the daemon's config file: {exc.strerror}", path=str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the daemon's config file is not valid TOML: {exc}", path=str(path)) from None


def _unknown(key: str, known: Mapping[str, Any], where: str) -> None:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
    raise ConfigError(f"unknown key {key!r} in {where}", hint=hint)


_KIND_WORDS = {"str": "a string", "path": "a path (string)", "int": "an integer", "float": "a number",
               "uids": "a list of user ids", "choice": "one of"}


def _convert(key: str, option: _Option, value: Any, where: str) -> Any:
    """``value`` (from TOML, a variable or a flag) as the option's kind; ConfigError naming ``where``."""
    from_text = isinstance(value, str) and option.kind not in ("str", "path", "choice")

    def wrong() -> ConfigError:
        expected = _KIND_WORDS[option.kind]
        if option.kind == "choice":
            expected = f"one of {', '.join(option.choices)}"
        shown = "a value of another kind" if key in _SECRET_KEYS else repr(value)  # never echo a secret
        return ConfigError(f"{where}: expected {expected}, got {shown}")

    try:
        if option.kind in ("str", "path", "choice"):
            if not isinstance(value, str) or (option.kind != "str" and not value):
                raise wrong()
            if option.kind == "choice" and value.lower() not in option.choices:
                raise wrong()
            converted: Any = value.lower() if option.kind == "choice" else value
            if option.kind == "path":
                converted = Path(value).expanduser()
            return converted
        if option.kind == "uids":
            items = [item for item in value.replace(",", " ").split()] if from_text else value
            if not isinstance(items, list) or not items:
                raise wrong()
            uids = [int(item) if isinstance(item, str) else item for item in items]
            if any(isinstance(uid, bool) or not isinstance(uid, int) or uid < 0 for uid in uids):
                raise wrong()
            return frozenset(uids)
        if isinstance(value, bool):
            raise wrong()
        if option.kind == "int":
            number: float = int(value) if from_text else value
            if not isinstance(number, int):
                raise wrong()
        else:
            number = float(value) if from_text else value
            if not isinstance(number, (int, float)):
                raise wrong()
            number = float(number)
    except ValueError:
        raise wrong() from None
    if option.minimum is not None and number < option.minimum:
        raise ConfigError(f"{where}: must be >= {option.minimum:g}, got {value!r}")
    return number


def _roots(tables: Any, single: dict[str, tuple[Any, str]], file_label: str) -> list[dict[str, Any]]:
    if not isinstance(tables, list) or not all(isinstance(table, dict) for table in tables):
        raise ConfigError(f"roots in {file_label}: expected [[roots]] tables")
    roots: list[dict[str, Any]] = []
    for number, table in enumerate(tables, start=1):
        root: dict[str, Any] = {"_where": f"[[roots]] #{number} in {file_label}"}
        for key, value in table.items():
            if key == "storage_options":
                if not isinstance(value, dict):
                    raise ConfigError(f"roots.storage_options in [[roots]] #{number} of {file_label}: expected a table")
                root["storage_options"] = value
                continue
            if key not in ROOT_OPTIONS:
                _unknown(key, {**ROOT_OPTIONS, "storage_options": None}, f"[[roots]] #{number} of {file_label}")
            root[key] = _convert(key, ROOT_OPTIONS[key], value, f"{key} in [[roots]] #{number} of {file_label}")
        roots.append(root)
    if single:
        if len(roots) > 1:
            names = ", ".join(f"{key} ({where})" for key, (_, where) in single.items())
            raise ConfigError(f"{names} describe a single root, but {file_label} has {len(roots)} roots",
                              hint="set these in the [[roots]] tables of the file instead")
        root = roots[0] if roots else {"_where": "flags"}
        if not roots:
            roots.append(root)
        for key, (value, where) in single.items():
            if key == "s3_endpoint_url":
                endpoint = _convert(key, _ROOT_FLAG_EXTRAS[key], value, where)
                options = dict(root.get("storage_options", {}))
                options["client_kwargs"] = {**options.get("client_kwargs", {}), "endpoint_url": endpoint}
                root["storage_options"] = options
            else:
                root[key] = _convert(key, ROOT_OPTIONS[key], value, where)
    return roots


def _build(values: dict[str, Any], roots: list[dict[str, Any]], where: dict[str, str],
           source: Path | None) -> DaemonConfig:
    if "state_dir" not in values:
        raise ConfigError("no state_dir: the daemon keeps its journal there",
                          hint="set state_dir in the config file, --state-dir or CKPTD_DAEMON_STATE_DIR")
    state_dir = _usable_directory(values["state_dir"], where["state_dir"])
    node_id = values.get("node_id") or socket_module.gethostname()
    if not _SAFE_NAME.match(node_id):
        raise ConfigError(f"{where.get('node_id', 'node_id (the host name)')}: {node_id!r} is not a usable node id",
                          hint="use letters, digits, '.', '_' and '-' (it names directories on the buddy)")
    listen = values.get("listen", OPTIONS["listen"].default)
    host, _ = _split_host_port(listen, where.get("listen", "listen"), "host:port, e.g. 127.0.0.1:9470")
    token = _token(values, where)
    if token is None and not is_loopback(host):
        raise ConfigError(f"{where.get('listen', 'listen')}: {listen!r} accepts connections from other machines, "
                          "and no peer token is set", hint="set peer_token_file (or CKPTD_PEER_TOKEN), or listen "
                          "on 127.0.0.1")
    buddy = values.get("buddy")
    if buddy is not None:
        buddy = _check_buddy(buddy, where["buddy"])
        if token is None:
            raise ConfigError(f"{where['buddy']}: replication to a buddy needs a peer token, and none is set",
                              hint="set peer_token_file (or CKPTD_PEER_TOKEN) to the token both daemons share")
    advertise = values.get("advertise")
    if advertise is not None:
        _check_advertise(advertise, where["advertise"])
    if buddy is not None and buddy.startswith("dns://") and advertise is None and _is_unspecified(host):
        raise ConfigError(f"{where['buddy']}: a dns:// buddy is the daemon after this node's own address, and "
                          f"listen {listen!r} names no address", hint="set advertise (CKPTD_DAEMON_ADVERTISE) to "
                          "this node's address as the name resolves it, e.g. the pod IP")
    socket_path = values.get("socket") or state_dir / "daemon.sock"
    if len(os.fsencode(str(socket_path))) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(f"{where.get('socket', 'socket (under state_dir)')}: the control socket path {socket_path} "
                          f"is longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket allows",
                          hint="set socket to a shorter path")
    _usable_directory(socket_path.parent, where.get("socket", "state_dir"))
    replica_dir = values.get("replica_dir")
    if replica_dir is not None:
        replica_dir = _usable_directory(replica_dir, where["replica_dir"])
    built_roots = tuple(_root(root) for root in roots)
    if source is not None:
        _check_inline_credentials(built_roots, roots, source)
    if not built_roots:
        raise ConfigError("no root to watch", hint="add a [[roots]] table with name and local, or pass --local")
    seen: dict[str, str] = {}
    locals_seen: dict[Path, str] = {}
    for root, raw in zip(built_roots, roots):
        if root.name in seen:
            raise ConfigError(f"root name {root.name!r} is used twice ({seen[root.name]} and {raw['_where']})",
                              hint="give every [[roots]] table its own name")
        seen[root.name] = raw["_where"]
        resolved = root.local.resolve()
        if resolved in locals_seen:
            raise ConfigError(f"roots {locals_seen[resolved]!r} and {root.name!r} watch the same directory {resolved}")
        locals_seen[resolved] = root.name
    if values.get("local_disk") == "separate":
        for root in built_roots:
            _check_separate_disk(root, state_dir, where.get("local_disk", "local_disk"))
    uids = values.get("control_allowed_uids") or frozenset({os.geteuid()})
    options = {key: values[key] for key in ("watch", "poll_interval_s", "scrub_interval_s", "scrub_bytes_per_s",
                                            "drain_timeout_s", "retry_backoff_s", "peer_max_concurrency",
                                            "peer_max_put_bytes", "log_level", "keep_peer", "cpu_policy",
                                            "local_disk")
               if key in values}
    return DaemonConfig(node_id=node_id, state_dir=state_dir, roots=built_roots, listen=listen,
                        socket=socket_path, control_allowed_uids=uids, peer_token=token,
                        peer_token_file=values.get("peer_token_file"), buddy=buddy, advertise=advertise,
                        replica_dir=replica_dir, source=source, **options)


def _root(raw: dict[str, Any]) -> RootConfig:
    where = raw["_where"]
    name = raw.get("name", ROOT_OPTIONS["name"].default)
    if not _SAFE_NAME.match(name):
        raise ConfigError(f"name in {where}: {name!r} is not a usable root name",
                          hint="use letters, digits, '.', '_' and '-' (it names a namespace on the buddy)")
    if "local" not in raw:
        raise ConfigError(f"{where}: root {name!r} has no local directory", hint="set local (or --local)")
    local = _usable_directory(raw["local"], f"local of root {name!r} ({where})")
    remote = raw.get("remote")
    if remote is not None:
        _check_remote(remote, f"remote of root {name!r} ({where})")
    for key in ("remote_every_steps", "keep_remote"):
        if raw.get(key) is not None and remote is None:
            raise ConfigError(f"{key} of root {name!r} ({where}) is set but the root has no remote",
                              hint="set remote = 's3://bucket/prefix' or drop the key")
    return RootConfig(name=name, local=local, remote=remote, remote_every_steps=raw.get("remote_every_steps"),
                      replicate_every_steps=raw.get("replicate_every_steps"), keep_local=raw.get("keep_local"),
                      keep_remote=raw.get("keep_remote"), storage_options=dict(raw.get("storage_options", {})))


def _check_separate_disk(root: RootConfig, state_dir: Path, where: str) -> None:
    """ConfigError when ``root.local`` is on the file system of ``state_dir`` or of ``/``."""
    device = root.local.stat().st_dev
    for other, what in ((state_dir, f"the state dir {state_dir}"), (Path("/"), "the root file system /")):
        if other.stat().st_dev == device:
            raise ConfigError(f"local of root {root.name!r} ({root.local}) is on the same disk as {what}, and {where} "
                              "asks for a disk of its own: is the NVMe it belongs on not mounted?",
                              hint="mount the local tier's disk there, or set local_disk = \"any\" to allow it")


#: ``storage_options`` keys (at any depth) whose values are credentials.
_CREDENTIAL_KEYS = frozenset({"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
                              "aws_session_token", "session_token"})


def _credential_keys(options: Mapping[str, Any], prefix: str = "") -> list[str]:
    found = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += _credential_keys(value, f"{prefix}{name}.")
        elif str(name).lower() in _CREDENTIAL_KEYS and value:
            found.append(f"{prefix}{name}")
    return found


def _check_inline_credentials(roots: tuple[RootConfig, ...], raw: list[dict[str, Any]], source: Path) -> None:
    """Credentials written into the config file's ``storage_options`` are refused unless only the daemon's
    user can read the file (mode 600): other users of the node would read them."""
    try:
        mode = source.stat().st_mode & 0o777
    except OSError:
        return
    for root, table in zip(roots, raw):
        keys = _credential_keys(root.storage_options)
        if keys and mode & 0o077:
            raise ConfigError(f"storage_options of root {root.name!r} ({table['_where']}) hold credentials "
                              f"({', '.join(keys)}) in a file other users can read (mode {mode:03o})",
                              hint="take them out: the AWS environment variables, a shared credentials file or "
                                   f"an instance/service-account role are read as usual; or chmod 600 {source}")


def _usable_directory(path: Path, where: str) -> Path:
    """``path`` made absolute, created when missing, and checked to be a directory this process can write."""
    path = Path(os.path.abspath(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{where}: {path} exists and is not a directory", hint="name a directory") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create the directory {path}: {exc.strerror}",
                          hint="create it, or name a directory this user can write") from None
    if not path.is_dir():
        raise ConfigError(f"{where}: {path} is not a directory", hint="name a directory")
    probe = path / f".ckptd-write-check-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{where}: the directory {path} is not writable: {exc.strerror}",
                          hint="fix its permissions or name another directory") from None
    return path


def _split_host_port(text: str, where: str, expected: str) -> tuple[str, int]:
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]/\s]+):(\d{1,5})", text)
    if not match:
        raise ConfigError(f"{where}: {text!r} is not {expected or 'host:port'}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ConfigError(f"{where}: port {port} is out of range (0-65535)")
    return host, port


def _check_remote(url: str, where: str) -> None:
    bucket = url[len("s3://"):].partition("/")[0] if url.startswith("s3://") else ""
    if bucket and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise ConfigError(f"{where}: {bucket!r} in {url!r} is not an S3 bucket name",
                          hint="bucket names are 3 to 63 lowercase letters, digits, dots and hyphens, beginning and "
                               "ending with a letter or digit")
    if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?", url):
        raise ConfigError(f"{where}: {url!r} is not an object-store URL",
                          hint="write it as s3://bucket/prefix (any S3-compatible store; set its endpoint_url in "
                               "storage_options or --s3-endpoint-url)")


def _check_buddy(url: str, where: str) -> str:
    scheme, separator, rest = url.partition("://")
    if scheme not in ("peer", "dns") or not separator:
        raise ConfigError(f"{where}: {url!r} is not a buddy URL", hint="write it as peer://HOST:PORT (one buddy) or "
                          "dns://NAME:PORT (a name listing every node's daemon, e.g. a headless Service)")
    _split_host_port(rest.rstrip("/"), where, f"{scheme}://HOST:PORT")
    return f"{scheme}://{rest.rstrip('/')}"


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _check_advertise(host: str, where: str) -> None:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        if not _HOST_NAME.fullmatch(host):
            raise ConfigError(f"{where}: {host!r} is not an IP address nor a host name",
                              hint="set advertise to the address other nodes reach this daemon at") from None


def _token(values: dict[str, Any], where: dict[str, str]) -> str | None:
    from ckptd.daemon.auth import check_token_strength

    if values.get("peer_token"):
        token = str(values["peer_token"])
        check_token_strength(token, where.get("peer_token", "peer_token"))
        return token
    path = values.get("peer_token_file")
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{where['peer_token_file']}: cannot read the peer token file {path}: {reason}",
                          hint="check the path and its permissions") from None
    if not token:
        raise ConfigError(f"{where['peer_token_file']}: the peer token file {path} is empty")
    check_token_strength(token, f"{where['peer_token_file']} ({path})")
    return token
