"""Fault-matrix rows 27, 29 and 38: the node daemon killed mid-upload, restarted mid-upload, and attacked.

Every run starts a real ``ckptd daemon`` process (:class:`~harness.daemon_process.DaemonProcess`) on a
copy of a local root in which steps 1 and 2 were committed (a 12 MiB tensor each, one chunk: a multipart
upload of 3 parts of 5 MiB; the template is written once per process), promoting to a fresh bucket of moto's
server on 127.0.0.1 (versioned, so that every PUT of a manifest stays countable).

- 27: the daemon is SIGKILLed once the multipart upload of step k's chunk holds N parts (k, N drawn from the
  seed; parts counted with moto's own ``ListParts``). At the kill nothing is visible at the key being
  uploaded and step k has no manifest on S3 (the manifest goes last); after a restart the upload is resumed
  (completed) or aborted (none left open, no dead owner record), each step is promoted once and restores
  bit-exact from S3 alone.
- 29: SIGTERM during the k-th copy (the copies slowed by :mod:`harness.slow_daemon`), with a drain
  deadline drawn from the seed; the harness SIGKILLs the daemon if it still runs after a wait also drawn
  from the seed (as an init system does); restart: each step has one journal row, done, and exactly one
  version of its manifest on S3 (no double commit); nothing lost.
- 38: a hostile client: a different UID on the control socket (root: a forked child that drops to UID
  65534; otherwise the daemon's allow-list excludes this UID and the real ``SO_PEERCRED`` of this process is
  refused), no or a wrong token on the peer endpoints (401), paths outside the roots and the files of an
  uncommitted step (refused, their bytes never sent), and every TCP listener of the daemon process (none on
  a wildcard address).
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptd.format.layout import MANIFEST_NAME, step_dir, step_file
from harness import invariants as inv
from harness.daemon_process import DaemonProcess, wait_until, write_config
from harness.matrix import Outcome, RunContext, S3Location, row

MIB = 1024 * 1024
#: 16 MiB: a 12 MiB tensor (one chunk, 3 multipart parts) and a 4 MiB one (one PUT).
WORKLOAD = inv.SyntheticWorkload(16 * MIB)
STEPS = (1, 2)
PART_BYTES = 5 * MIB
#: Parts of one chunk's multipart upload (12 MiB in parts of 5 MiB).
PARTS = 3
#: The daemon's object tier sends one part at a time, so that a kill lands after a known number of parts.
UPLOAD_ENV = {"CKPTD_S3_PART_BYTES": str(PART_BYTES), "CKPTD_S3_CONCURRENCY": "1"}

_template: dict[str, Path] = {}


# --- the committed root, the daemon, S3 ----------------------------------------------------------

def _committed_root(ctx: RunContext) -> Path:
    """A copy (in this run's scratch directory) of a root holding :data:`STEPS` committed by a real
    CheckpointManager; the template is written once per process."""
    if "root" not in _template:
        from ckptd.manager.manager import CheckpointManager
        from ckptd.policy import Policy

        base = Path(tempfile.mkdtemp(prefix="ckptd-matrix-daemon-template-"))
        atexit.register(shutil.rmtree, base, ignore_errors=True)
        with CheckpointManager(base / "root", capture_rng=False, policy=Policy(keep_local=None),
                               daemon="off") as manager:
            for step in STEPS:
                manager.save(step, WORKLOAD.state(step))
                manager.wait()
        _template["root"] = base / "root"
    root = ctx.workdir / "root"
    shutil.copytree(_template["root"], root)
    return root


def _client(s3: S3Location) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _versioned_bucket(ctx: RunContext) -> tuple[S3Location, Any]:
    s3 = ctx.s3("run1")
    client = _client(s3)
    client.put_bucket_versioning(Bucket=s3.bucket, VersioningConfiguration={"Status": "Enabled"})
    return s3, client


def _config(ctx: RunContext, root: Path, s3: S3Location | None, **options: Any) -> tuple[Path, Path]:
    state = ctx.workdir / "state"
    table: dict[str, Any] = {"name": "run1", "local": str(root)}
    if s3 is not None:
        table.update(remote=s3.url, storage_options=s3.storage_options)
    settings = dict(node_id="node-a", listen="127.0.0.1:0", poll_interval_s=0.1, retry_backoff_s=0.1,
                    scrub_interval_s=0)
    settings.update(options)
    return write_config(ctx.workdir / "daemon.toml", [table], state_dir=str(state), **settings), state


def _open_uploads(client: Any, bucket: str) -> dict[str, str]:
    """Upload id -> key of every multipart upload of the bucket neither completed nor aborted."""
    return {item["UploadId"]: item["Key"] for item in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}


def _keys(client: Any, bucket: str, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def _manifests(client: Any, s3: S3Location) -> dict[int, str]:
    """Step -> ETag of every manifest object on S3 (the commit marker: what makes a step visible)."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix="run1/"):
        for item in page.get("Contents", []):
            for step in STEPS:
                if item["Key"] == f"run1/{step_file(step, MANIFEST_NAME)}":
                    found[step] = item["ETag"]
    return found


def _check_manifests_kept(before: dict[int, str], client: Any, s3: S3Location) -> inv.Check:
    """L2 on S3: every manifest there at the fault is still there, the same object."""
    after = _manifests(client, s3)
    changed = {step: (tag, after.get(step)) for step, tag in before.items() if after.get(step) != tag}
    return inv.Check("L2", not changed, f"manifests on S3 gone or rewritten since the fault: {changed}")


def _manifest_versions(client: Any, s3: S3Location, step: int) -> int:
    key = f"run1/{step_file(step, MANIFEST_NAME)}"
    listing = client.list_object_versions(Bucket=s3.bucket, Prefix=key)
    return sum(1 for version in listing.get("Versions", []) if version["Key"] == key)


def _promote_rows(daemon: DaemonProcess) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = {}
    for task in daemon.tasks():
        if task["kind"] == "promote":
            rows.setdefault(task["step"], []).append(task)
    return rows


def _all_promoted(daemon: DaemonProcess) -> bool:
    rows = _promote_rows(daemon)
    return sorted(rows) == list(STEPS) and all(task["state"] == "done" for tasks in rows.values() for task in tasks)


def _check_promoted_once(daemon: DaemonProcess, client: Any, s3: S3Location) -> list[inv.Check]:
    """L2/L3: one journal row per step, done; one version of each step's manifest on S3 (one commit)."""
    checks = []
    rows = _promote_rows(daemon)
    doubled = {step: [(task["id"], task["state"]) for task in tasks] for step, tasks in rows.items()
               if len(tasks) != 1 or tasks[0]["state"] != "done"}
    checks.append(inv.Check("L2", sorted(rows) == list(STEPS) and not doubled,
                            f"journal promote rows per step: {doubled or sorted(rows)}"))
    versions = {step: _manifest_versions(client, s3, step) for step in STEPS}
    checks.append(inv.Check("L3", all(count == 1 for count in versions.values()),
                            f"manifest PUTs that landed per step (must be 1 each): {versions}"))
    return checks


def _check_uploads_closed(client: Any, s3: S3Location) -> inv.Check:
    """L3: no multipart upload left open and no owner record of a dead writer left behind."""
    left = _open_uploads(client, s3.bucket)
    records = _keys(client, s3.bucket, "run1/uploads/")
    return inv.Check("L3", not left and not records,
                     f"after the restart: open uploads {sorted(left.values())}, owner records {records}")


def _restart_until_promoted(ctx: RunContext, config: Path, state: Path, s3: S3Location, client: Any
                            ) -> tuple[DaemonProcess, float]:
    """Start the daemon again; wait until every step is promoted, no upload is left open and no dead owner's
    record is left; stop it (exit 0).
    Returns the stopped daemon and the seconds from the fault to every step restorable from S3."""
    with DaemonProcess(config, state, env=UPLOAD_ENV) as daemon:
        daemon.wait_ready()
        daemon.wait_for(lambda: _all_promoted(daemon), 60, "every step promoted after the restart")
        recovery_s = ctx.stopwatch.since_fault()
        # the upkeep's first pass aborts an upload a dead writer left open and deletes the records of dead
        # owners (one stays behind when the killed daemon's own abort may have landed unanswered)
        daemon.wait_for(lambda: not _open_uploads(client, s3.bucket) and not _keys(client, s3.bucket, "run1/uploads/"),
                        30, "the interrupted upload closed and its dead owner's record removed")
        code = daemon.terminate()
        if code != 0:
            raise AssertionError(f"the restarted daemon exited with {code}: {daemon.log()}")
    return daemon, recovery_s


def _after_restart(ctx: RunContext, daemon: DaemonProcess, client: Any, s3: S3Location, root: Path,
                   before_local: inv.CommittedRecord, before_remote: dict[int, str]) -> list[inv.Check]:
    """What must hold once the restarted daemon promoted everything: each step promoted once, no upload
    left open, nothing lost on either tier, every step on S3 verifies, the newest restores bit-exact from S3
    alone (a node whose local tier is gone)."""
    checks = _check_promoted_once(daemon, client, s3)
    checks.append(_check_uploads_closed(client, s3))
    checks.append(inv.check_nothing_lost(before_local, root))
    checks.append(_check_manifests_kept(before_remote, client, s3))
    checks.append(inv.check_nothing_partial(s3, allowed=STEPS))
    checks.append(inv.check_newest_restores(WORKLOAD, remote=s3, expected_step=STEPS[-1], scratch=ctx.workdir))
    return checks


# --- row 27 ----------------------------------------------------------------------------------------

def _wait_for_parts(daemon: DaemonProcess, client: Any, bucket: str, upload_number: int, parts: int,
                    timeout_s: float = 60.0) -> tuple[str, int]:
    """Poll moto until the ``upload_number``-th multipart upload the daemon opened holds ``parts`` parts;
    returns (its key, the parts it held). When it completes between two polls, or opens and completes
    between two polls of a loaded machine (then only its stored chunk shows it), (its key, -1)."""
    seen: list[str] = []  # the uploads' keys, in the order they appeared (one upload per chunk key)
    uploads: dict[str, str] = {}  # key -> upload id, of those seen open
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            raise AssertionError(f"the daemon exited with {daemon.process.returncode}: {daemon.log()}")
        open_now = _open_uploads(client, bucket)
        for upload, key in open_now.items():
            if key not in seen:
                seen.append(key)
                uploads[key] = upload
        completed = [] if open_now else client.list_objects_v2(Bucket=bucket).get("Contents", [])
        seen += sorted(item["Key"] for item in completed
                       if "/chunks/" in item["Key"] and item["Size"] > PART_BYTES and item["Key"] not in seen)
        if len(seen) >= upload_number:
            key = seen[upload_number - 1]
            if uploads.get(key) not in open_now:
                return key, -1
            held = len(client.list_parts(Bucket=bucket, Key=key, UploadId=uploads[key]).get("Parts", []))
            if held >= parts:
                return key, held
        time.sleep(0.005)
    raise AssertionError(f"upload {upload_number} never reached {parts} parts (saw {len(seen)} uploads)")


@row(27, "daemon SIGKILLed after N parts of a multipart upload", short_runs=1, long_runs=30)
def daemon_killed_after_parts(ctx: RunContext) -> Outcome:
    victim = ctx.rng.choice(STEPS)  # whose chunk upload is cut (uploads run in step order)
    parts = ctx.rng.randint(1, PARTS - 1)
    root = _committed_root(ctx)
    before_local = inv.record_committed(root)
    s3, client = _versioned_bucket(ctx)
    config, state = _config(ctx, root, s3)
    with DaemonProcess(config, state, env=UPLOAD_ENV) as daemon:
        daemon.wait_ready()
        key, held = _wait_for_parts(daemon, client, s3.bucket, victim, parts)
        daemon.kill()
    ctx.stopwatch.fault()
    note = (f"killed with {held} of {PARTS} parts of step {victim}'s chunk uploaded" if held >= 0 else
            f"the upload of step {victim}'s chunk completed before the kill (N={parts} missed)")
    checks = []
    open_keys = set(_open_uploads(client, s3.bucket).values())
    visible = set(_keys(client, s3.bucket))
    checks.append(inv.Check("L3", not open_keys & visible,
                            f"keys visible while their upload is open: {sorted(open_keys & visible)}"))
    if 0 <= held < PARTS:  # with every part sent at the last poll, the completion may beat the kill
        checks.append(inv.Check("L3", key in open_keys and key not in visible,
                                f"{key}: open {key in open_keys}, visible {key in visible} at the kill"))
    before_remote = _manifests(client, s3)
    early = sorted(step for step in before_remote if step >= victim)
    checks.append(inv.Check("L3", not early, f"step(s) {early} committed on S3 while step {victim}'s chunk was "
                                             "still uploading (the manifest must go last)"))
    daemon, recovery_s = _restart_until_promoted(ctx, config, state, s3, client)
    checks += _after_restart(ctx, daemon, client, s3, root, before_local, before_remote)
    return inv.outcome(checks, recovery_s=recovery_s, detail=note)


# --- row 29 ----------------------------------------------------------------------------------------

@row(29, "daemon SIGTERMed mid-upload, SIGKILLed past its drain deadline, restarted", short_runs=1, long_runs=30)
def daemon_terminated_mid_upload(ctx: RunContext) -> Outcome:
    writes = ctx.rng.randint(1, 6)  # SIGTERM during the daemon's k-th copy to S3 (each step: 3 or 4 copies)
    drain_s = ctx.rng.choice([0.05, 0.3, 5.0])
    patience_s = ctx.rng.uniform(0.0, 1.0)  # how long the "init system" waits past the drain deadline
    root = _committed_root(ctx)
    before_local = inv.record_committed(root)
    s3, client = _versioned_bucket(ctx)
    config, state = _config(ctx, root, s3, drain_timeout_s=drain_s)
    with DaemonProcess(config, state, env=UPLOAD_ENV, slow_writes_s=0.1) as daemon:
        daemon.wait_ready()
        daemon.wait_event(lambda line: line.startswith("write object "), count=writes)
        daemon.process.terminate()
        ctx.stopwatch.fault()
        try:
            code = daemon.process.wait(drain_s + patience_s)
            ending = f"exited {code} by itself"
        except subprocess.TimeoutExpired:  # it outlived the deadline
            daemon.kill()
            ending = "SIGKILLed past its drain deadline"
            code = 0
    note = f"SIGTERM during copy {writes}, drain {drain_s:g}s, waited {patience_s:.2f}s more: {ending}"
    checks = [inv.Check("L2", code == 0, f"the drained daemon exited with {code}")]
    before_remote = _manifests(client, s3)
    daemon, recovery_s = _restart_until_promoted(ctx, config, state, s3, client)
    checks += _after_restart(ctx, daemon, client, s3, root, before_local, before_remote)
    return inv.outcome(checks, recovery_s=recovery_s, detail=note)


# --- row 38 ----------------------------------------------------------------------------------------

TOKEN = "matrix-peer-token-0123456789abcdef"
#: A UID no trainer runs as (``nobody``), for the forked client when this process is root.
OTHER_UID = 65534
UNCOMMITTED = 3
_LOOPBACK = {"127.0.0.1", "::1"}


def _escapes(secret: str) -> list[str]:
    """Peer paths that try to leave the served root (it is ``<workdir>/root``; ``secret`` is
    ``<workdir>/outside/<name>``), or reach files that are not committed chunks."""
    return [f"/v1/peer/roots/run1/../outside/{secret}",
            f"/v1/peer/roots/run1/{step_dir(1)}/../../outside/{secret}",
            f"/v1/peer/roots/run1/%2e%2e/outside/{secret}",
            f"/v1/peer/roots/run1/{step_dir(1)}/..%2F..%2Foutside%2F{secret}",
            f"/v1/peer/roots/run1/{step_dir(1)}/%252e%252e%252f{secret}",
            f"/v1/peer/roots/run1/{step_dir(1)}/..%5c..%5coutside%5c{secret}",
            f"/v1/peer/roots/run1/{step_dir(1)}/{secret}%00.data",
            f"/v1/peer/roots/run1/%2f{secret}",
            "/v1/peer//etc/passwd",
            f"/v1/peer/roots/run1/{step_dir(1)}/.ckptd-secret",
            f"/v1/peer/roots/run1/{step_dir(UNCOMMITTED)}/rank-00000.data",
            f"/v1/peer/roots/run1/{step_dir(UNCOMMITTED)}/{MANIFEST_NAME}"]


def _request(address: str, method: str, path: str, token: str | None) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        if token is not None:
            connection.putheader("Authorization", f"Bearer {token}")
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _ask_over_socket(path: Path, request: dict[str, Any], *, as_uid: int | None) -> bytes:
    """Send one control request on the socket ``path`` and return the answer line; with ``as_uid`` from a
    forked child that drops to that UID first (root only)."""
    def ask() -> bytes:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        try:
            client.connect(str(path))
            try:
                client.sendall(json.dumps(request).encode() + b"\n")
            except BrokenPipeError:  # refused already: the refusal is still there to read
                pass
            answer = b""
            while not answer.endswith(b"\n"):
                received = client.recv(4096)
                if not received:
                    break
                answer += received
            return answer or b"<closed>"
        finally:
            client.close()

    if as_uid is None:
        return ask()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # the child: drop to as_uid, ask, report through the pipe
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(as_uid)
            os.setuid(as_uid)
            os.write(writer, ask())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            os.write(writer, f"<child failed: {error!r}>".encode())
        finally:
            os._exit(0)
    os.close(writer)
    chunks = []
    while chunk := os.read(reader, 65536):
        chunks.append(chunk)
    os.close(reader)
    os.waitpid(child, 0)
    return b"".join(chunks)


def _listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in process ``pid`` and its children."""
    import psutil

    process = psutil.Process(pid)
    found = []
    for member in [process, *process.children(recursive=True)]:
        for connection in member.net_connections(kind="inet"):
            if connection.status == psutil.CONN_LISTEN:
                found.append((connection.laddr.ip, connection.laddr.port))
    return found


def _check_uid(daemon: DaemonProcess, socket_path: Path, root: Path) -> list[inv.Check]:
    """L4: a client of a UID the allow-list lacks is refused before its message is read."""
    report = {"op": "report", "root": str(root.resolve()), "step": 7, "save_stall_s": 0.123, "step_s": 4.5}
    uid = OTHER_UID if os.geteuid() == 0 else os.geteuid()
    how = "forked child as UID 65534" if os.geteuid() == 0 else f"this process (UID {uid}), not in the allow-list"
    answer = _ask_over_socket(socket_path, report, as_uid=OTHER_UID if os.geteuid() == 0 else None)
    try:
        refusal = json.loads(answer)
    except ValueError:
        refusal = {}
    refused = refusal.get("ok") is False and f"UID {uid}" in str(refusal.get("error"))
    landed = daemon.get_json("/status")["roots"]["run1"].get("trainer_report")
    return [inv.Check("L4", refused, f"{how}: answered {answer[:200]!r}"),
            inv.Check("L4", f"refused a control connection from UID {uid}" in daemon.log(), "refusal not logged"),
            inv.Check("L4", landed is None, f"the refused client's report was processed: {landed}")]


def _check_peer_api(address: str, root: Path, secret: Path) -> list[inv.Check]:
    """L4: 401 without the right token; 4xx and none of the bytes for paths outside the root or in an
    uncommitted step; the right token gets the committed file (the endpoint works at all)."""
    committed = f"/v1/peer/roots/run1/{step_dir(1)}/rank-00000.index.json"
    expected = (root / step_dir(1) / "rank-00000.index.json").read_bytes()
    checks = []
    status, body = _request(address, "GET", committed, TOKEN)
    checks.append(inv.Check("L4", (status, body) == (200, expected), f"the right token got {status}"))
    for token in (None, "", "wrong-token", TOKEN[:-1], TOKEN.upper()):
        for method, path in (("GET", committed), ("HEAD", committed), ("GET", "/v1/peer/roots/run1/steps")):
            status, body = _request(address, method, path, token)
            checks.append(inv.Check("L4", status == 401 and expected not in body,
                                    f"{method} {path} with token {token!r}: {status}"))
    private = [secret.read_bytes(), (root / step_dir(UNCOMMITTED) / "rank-00000.data").read_bytes()]
    for path in _escapes(secret.name):
        for method in ("GET", "HEAD"):
            status, body = _request(address, method, path, TOKEN)
            leaked = [piece[:16] for piece in private if piece in body]
            checks.append(inv.Check("L4", 400 <= status < 500 and not leaked,
                                    f"{method} {path}: {status}, leaked {leaked}"))
    return checks


@row(38, "hostile client of the daemon API", short_runs=1, long_runs=100)
def hostile_daemon_client(ctx: RunContext) -> Outcome:
    root = _committed_root(ctx)
    uncommitted = root / step_dir(UNCOMMITTED)
    uncommitted.mkdir()
    (uncommitted / "rank-00000.data").write_bytes(b"UNCOMMITTED-BYTES-" + ctx.rng.randbytes(16).hex().encode())
    outside = ctx.path("outside")
    secret = outside / f"secret-{ctx.rng.randrange(10**6)}.txt"
    secret.write_bytes(b"SECRET-BYTES-" + ctx.rng.randbytes(16).hex().encode())
    canary = inv.plant_canary(outside)
    untouched = inv.snapshot_tree(outside)
    socket_dir = Path(tempfile.mkdtemp(prefix="ckptd-m38-"))  # short, and enterable by every UID
    socket_dir.chmod(0o755)
    # not root: no second UID to connect as, so the allow-list leaves this process's own UID out
    allowed = {} if os.geteuid() == 0 else {"control_allowed_uids": [os.geteuid() + 1]}
    try:
        config, state = _config(ctx, root, None, socket=str(socket_dir / "d.sock"), peer_token=TOKEN, **allowed)
        with DaemonProcess(config, state) as daemon:
            address = daemon.wait_ready()["http"]
            checks = _check_uid(daemon, socket_dir / "d.sock", root)
            checks += _check_peer_api(address, root, secret)
            listening = _listeners(daemon.process.pid)
            wildcard = [entry for entry in listening if entry[0] not in _LOOPBACK]
            checks.append(inv.Check("L4", bool(listening) and not wildcard,
                                    f"TCP listeners of the daemon: {listening} (non-loopback: {wildcard})"))
            code = daemon.terminate()
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    checks.append(inv.Check("L4", code == 0, f"the daemon exited with {code}"))
    checks += [inv.check_untouched(untouched), inv.check_canary(canary)]
    mode = "UID check as UID 65534 (root)" if os.geteuid() == 0 else "UID check by allow-list (not root)"
    return inv.outcome(checks, detail=f"{mode}; {len(listening)} listener(s): {listening}")
