"""deploy/ agrees with the real ckptd and with the platforms it targets, checked offline.

- every Kubernetes manifest parses and validates in strict mode (unknown fields are errors) against the
  API schemas ``kubernetes-validate`` ships, for the oldest and the newest version checked; the
  kustomization lists every manifest but the two applied on their own, and its build validates too;
- the DaemonSet has the security posture and the probes the issue asks for, and the training Job shares
  the daemon's host directories, socket, UID and root (read from the ConfigMap's TOML);
- every ``ckptd`` command and flag the manifests, the unit, the Dockerfile, the comments and docs/deploy.md
  use exists in the matching ``ckptd ... --help`` output (the real CLI in a subprocess),
  and every ``CKPTD_*`` variable they set is one ckptd reads;
- the example TOML names every option of ``ckptd daemon --help``, and it, the ConfigMap's TOML and the
  systemd environment file pass ``ckptd daemon --check-config`` (paths moved under a temporary directory);
- the systemd unit passes ``systemd-analyze verify`` and keeps its exposure score low (skipped, saying
  why, where systemd-analyze is missing);
- the Dockerfile's build context holds what the build copies and builds a wheel with the daemon in it;
  the image itself builds where a container engine answers (``slow``; skipped, saying so, otherwise);
- the ConfigMap's TOML with the DaemonSet's environment starts a real daemon whose probe paths answer, and
  the example training script, run under ``ckptd launch`` with the Job's environment, hands its steps to
  it through the configured socket and resumes when run again; the daemon promotes them to moto's S3.
  Where the machine allows a private mount namespace, both see a read-only root file system but /tmp.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # the dev extra: Kubernetes' API schemas, offline
import kubernetes_validate.utils
import pytest
import yaml  # PyYAML, a dependency of kubernetes-validate

from harness.daemon_process import wait_until

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
UNIT = DEPLOY / "systemd" / "ckptd-daemon.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "ckptd-daemon.env.example"
EXAMPLE_TOML = DEPLOY / "daemon.example.toml"
DOCKERFILE = DEPLOY / "Dockerfile"
CKPTD = str(Path(sys.executable).with_name("ckptd"))
#: Oldest Kubernetes version the manifests support, and the newest the installed schemas know.
K8S_VERSIONS = ("1.28.0", kubernetes_validate.utils.latest_version())
#: Manifests deliberately left out of kustomization.yaml (its comment says why).
APPLIED_ON_THEIR_OWN = {"secret.example.yaml", "training-job.yaml"}
#: ``ckptd daemon`` flags that describe a single root (TOML: keys of a [[roots]] table) or run the command.
ROOT_FLAGS = {"--name", "--local", "--remote", "--s3-endpoint-url", "--remote-every-steps",
              "--replicate-every-steps", "--keep-local", "--keep-remote"}
COMMAND_FLAGS = {"--config", "--check-config", "--print-token", "--token-node-id", "--help", "-h"}
#: Host paths the deploy files use, and where the config checks move them.
HOST_PATHS = ("/var/lib/ckptd", "/run/ckptd", "/mnt/nvme/ckpt", "/nvme/ckpt", "/etc/ckptd-peer", "/etc/ckptd")


# --- the real CLI -------------------------------------------------------------------------------------

@functools.cache
def _help(*command: str) -> str:
    """``ckptd COMMAND... --help`` of the installed console script; fails the test when it fails."""
    done = subprocess.run([CKPTD, *command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"`ckptd {' '.join(command)} --help` failed: {done.stderr.strip()[-500:]}"
    return done.stdout


def _options(help_text: str) -> dict[str, bool]:
    """Each option of a click help page and whether it takes a value (``--config FILE``: yes)."""
    found: dict[str, bool] = {}
    for line in help_text.splitlines():
        if not re.match(r"^  -", line):
            continue
        head = re.split(r"\s{2,}", line.strip())[0]
        names = re.findall(r"(?<![\w-])--?[A-Za-z0-9][\w-]*", head)
        rest = re.sub(r"(?<![\w-])--?[A-Za-z0-9][\w-]*|,|/", "", head).strip()
        found.update(dict.fromkeys(names, bool(rest)))
    return found


def _commands(help_text: str) -> set[str]:
    section = help_text.partition("\nCommands:\n")[2]
    return {match.group(1) for match in re.finditer(r"^  ([a-z][\w-]*)\s", section, re.MULTILINE)}


def _invocation_problems(argv: list[str], where: str, *, exact: bool) -> list[str]:
    """What in ``ckptd ARGS`` the real CLI does not know: the (sub)commands, and every option up to the
    first positional argument (the rest may belong to a training script). ``exact`` (a command line, not
    a mention in prose): also a positional argument given to a command that takes none."""
    command: list[str] = []
    tokens = list(argv[1:])
    while tokens and tokens[0] in _commands(_help(*command)):
        command.append(tokens.pop(0))
    if not command:
        return [f"{where}: `ckptd {' '.join(argv[1:])}` names no ckptd command (known: "
                f"{', '.join(sorted(_commands(_help())))})"]
    options, problems = _options(_help(*command)), []
    while tokens and tokens[0].startswith("-") and tokens[0] != "-":
        token = tokens.pop(0)
        name = token.split("=", 1)[0]
        if name not in options:
            problems.append(f"{where}: `ckptd {' '.join(command)}` has no option {name}")
        elif options[name] and "=" not in token and tokens:
            tokens.pop(0)
    usage = _help(*command).partition("Usage: ")[2].splitlines()[0]
    if exact and tokens and usage.rstrip().endswith("[OPTIONS]"):
        problems.append(f"{where}: `ckptd {' '.join(command)}` takes no argument, given {tokens[0]!r}")
    return problems


def _known_variable(name: str) -> bool:
    """Whether ckptd reads the variable ``name``: named in a help page, in ckptd's source, or the
    ``CKPTD_DAEMON_X_Y`` of a ``ckptd daemon --x-y`` option."""
    if name.startswith("CKPTD_DAEMON_"):
        if "--" + name.removeprefix("CKPTD_DAEMON_").lower().replace("_", "-") in _options(_help("daemon")):
            return True
    if any(name in _help(*command) for command in ([], ["daemon"], ["launch"])):
        return True
    return any(name in path.read_text(encoding="utf-8") for path in (REPO / "ckptd").rglob("*.py"))


# --- reading the deploy files -------------------------------------------------------------------------

def _manifest_files() -> list[Path]:
    return sorted(path for path in K8S.glob("*.yaml") if path.name != "kustomization.yaml")


def _documents(path: Path) -> list[dict[str, Any]]:
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document is not None]
    assert documents, f"{path.name} holds no manifest"
    return documents


def _by_kind(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [document for path in _manifest_files() for document in _documents(path)
             if document["kind"] == kind and (name is None or document["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod_spec(document: dict[str, Any]) -> dict[str, Any]:
    return document["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def _host_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Host path -> mount path of ``container``'s hostPath volumes."""
    host = {volume["name"]: volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    return {host[mount["name"]]: mount["mountPath"] for mount in container["volumeMounts"] if mount["name"] in host}


def _configmap_toml() -> dict[str, Any]:
    return tomllib.loads(_by_kind("ConfigMap", "ckptd-config")["data"]["daemon.toml"])


def _dockerfile_instruction(name: str) -> list[str]:
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"the Dockerfile needs one {name}"
    return json.loads(lines[0].removeprefix(name + " "))


def _deploy_page() -> str:
    text = (REPO / "docs" / "deploy.md").read_text()
    assert text.startswith("# Deploying the daemon"), "docs/deploy.md is not the 'Deploying the daemon' page"
    return text


def _invocations() -> Iterator[tuple[list[str], str, bool]]:
    """Every ``ckptd ...`` command line of deploy/ and of docs/deploy.md, and whether it is
    one (not a mention in a comment or prose, whose words after the command need not be arguments)."""
    yield ["ckptd", *_dockerfile_instruction("ENTRYPOINT")[1:], *_dockerfile_instruction("CMD")], "Dockerfile", True
    for line in UNIT.read_text().splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line.removeprefix("ExecStart="))
            assert Path(argv[0]).name == "ckptd", f"the unit runs {argv[0]}, not ckptd"
            yield ["ckptd", *argv[1:]], UNIT.name, True
    entrypoint = _dockerfile_instruction("ENTRYPOINT")
    for path in _manifest_files():
        for document in _documents(path):
            if "template" not in document.get("spec", {}):
                continue
            for container in _containers(_pod_spec(document)):
                argv = [*(container.get("command") or entrypoint), *container.get("args", [])]
                if Path(argv[0]).name == "ckptd":
                    yield ["ckptd", *argv[1:]], f"{path.name} container {container['name']}", True
    texts = {path.name: path.read_text() for path in DEPLOY.rglob("*") if path.is_file()}
    texts["docs/deploy.md"] = _deploy_page()
    subcommands = "|".join(sorted(_commands(_help())))
    for name, text in texts.items():
        for match in re.finditer(rf"(?<![\w.-])ckptd ((?:{subcommands})(?=[\s`]|$)[^\n`#&|;)]*)", text):
            yield ["ckptd", *match.group(1).split()], f"{name}: `ckptd {match.group(1).strip()}`", False


def _variables_set() -> Iterator[tuple[str, str]]:
    """Every ``CKPTD_*`` variable deploy/ sets, and where."""
    for path in _manifest_files():
        for document in _documents(path):
            if "template" in document.get("spec", {}):
                for container in _containers(_pod_spec(document)):
                    for name in _env(container):
                        yield name, f"{path.name} container {container['name']}"
            for name in document.get("stringData", {}):
                yield name, f"{path.name} Secret {document['metadata']['name']}"
    for path in (UNIT, ENV_EXAMPLE):
        for match in re.finditer(r"^(?:#\s*)?(?:Environment=)?(CKPTD_[A-Z0-9_]+)=", path.read_text(), re.MULTILINE):
            yield match.group(1), path.name


# --- Kubernetes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", _manifest_files(), ids=lambda path: path.name)
def test_manifest_validates_against_the_api_schemas(path: Path) -> None:
    for document in _documents(path):
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.utils.ValidationError as error:
                pytest.fail(f"{path.name}: {document['kind']} {document['metadata']['name']} is not valid "
                            f"Kubernetes {version}: {error.message} at {'/'.join(map(str, error.absolute_path))}")


def test_kustomization_lists_every_manifest_and_builds_valid_objects() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert all((K8S / name).is_file() for name in listed), "kustomization.yaml lists a missing file"
    assert listed | APPLIED_ON_THEIR_OWN == {path.name for path in _manifest_files()}, \
        "a manifest is neither in kustomization.yaml nor applied on its own"
    assert not listed & APPLIED_ON_THEIR_OWN
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize build itself is not checked here")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    documents = list(yaml.safe_load_all(built.stdout))
    assert {document["kind"] for document in documents} == {"Namespace", "ServiceAccount", "ConfigMap", "Service",
                                                            "DaemonSet", "NetworkPolicy", "PriorityClass"}
    for document in documents:
        kubernetes_validate.validate(document, K8S_VERSIONS[-1], strict=True)
        if document["kind"] not in ("Namespace", "PriorityClass"):  # cluster-scoped
            assert document["metadata"]["namespace"] == kustomization["namespace"]


def test_daemonset_is_locked_down_and_probed() -> None:
    daemonset = _by_kind("DaemonSet")
    pod = _pod_spec(daemonset)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    (daemon,) = [container for container in pod["containers"] if container["name"] == "daemon"]
    context = daemon["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"] and "add" not in context["capabilities"]
    for init in pod.get("initContainers", []):  # may chown the host directories, nothing else
        assert set(init["securityContext"]["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER"}
        assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert daemon["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for container in _containers(pod):
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]) & set(container["resources"]["limits"])
    config = _configmap_toml()
    assert pod["terminationGracePeriodSeconds"] > config.get("drain_timeout_s", 30), \
        "Kubernetes would SIGKILL the daemon before its drain deadline"
    assert _host_mounts(pod, daemon)["/var/lib/ckptd"] == config["state_dir"], "the journal must outlive the pod"
    env = _env(daemon)
    assert env["CKPTD_DAEMON_LISTEN"].startswith("$(POD_IP):") and "peer_token_file" in config
    assert env["CKPTD_DAEMON_NODE_ID"] == "$(NODE_NAME)", "the node id must survive pod restarts"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    token_mount = next(mount for mount in daemon["volumeMounts"]
                       if config["peer_token_file"].startswith(mount["mountPath"] + "/"))
    assert "secret" in volumes[token_mount["name"]], "the peer token must come from a Secret"
    assert any("secretRef" in source for source in daemon["envFrom"]), "S3 credentials come from a Secret"
    service = _by_kind("Service", "ckptd-peer")
    assert service["spec"]["selector"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    port = {entry["name"]: entry["containerPort"] for entry in daemon["ports"]}["http"]
    assert env["CKPTD_DAEMON_LISTEN"].endswith(f":{port}")


def test_one_daemonset_finds_buddies_through_the_headless_service() -> None:
    """Every node runs the same config: its buddy is the daemon after its own pod IP among the addresses of
    the headless Service (ckptd.daemon.buddy), so the name and port must be that Service's."""
    service = _by_kind("Service", "ckptd-peer")
    assert service["spec"]["clusterIP"] == "None", "only a headless Service lists every daemon's address"
    namespace = service["metadata"]["namespace"]
    port = {entry["name"]: entry["port"] for entry in service["spec"]["ports"]}["http"]
    assert _configmap_toml()["buddy"] == f"dns://{service['metadata']['name']}.{namespace}.svc:{port}"
    (daemon,) = [container for container in _pod_spec(_by_kind("DaemonSet"))["containers"]
                 if container["name"] == "daemon"]
    env = _env(daemon)
    assert "CKPTD_DAEMON_BUDDY" not in env, "a per-node buddy in the one DaemonSet pairs every node with one"
    assert env["CKPTD_DAEMON_LISTEN"] == f"$(POD_IP):{port}", "the ring's own address is the listen host"


def test_training_job_shares_the_daemons_directories_socket_and_uid() -> None:
    config = _configmap_toml()
    daemon_pod, job_pod = _pod_spec(_by_kind("DaemonSet")), _pod_spec(_by_kind("Job"))
    daemon = next(container for container in daemon_pod["containers"] if container["name"] == "daemon")
    (trainer,) = job_pod["containers"]
    daemon_mounts, shared = _host_mounts(daemon_pod, daemon), _host_mounts(job_pod, trainer)
    assert shared and shared.items() <= daemon_mounts.items(), \
        "the job must mount the daemon's host directories at the same paths"
    socket = Path(config["socket"])
    assert any(socket.parent == Path(path) for path in shared.values()), "the job cannot reach the control socket"
    env = _env(trainer)
    assert env["CKPTD_DAEMON_SOCKET"] == config["socket"]
    roots = {root["local"]: root for root in config["roots"]}
    assert env["CKPT_LOCAL"] in roots, "the job's local root is no [[roots]] table of the daemon"
    assert env["CKPT_REMOTE"] == roots[env["CKPT_LOCAL"]]["remote"]
    assert any(env["CKPT_LOCAL"].startswith(path + "/") for path in shared.values())
    assert job_pod["securityContext"]["runAsUser"] in config["control_allowed_uids"]
    assert job_pod["securityContext"]["runAsUser"] == daemon_pod["securityContext"]["runAsUser"]
    assert env["CKPTD_PEER_TOKEN_FILE"] == config["peer_token_file"]


# --- the CLI the files use ----------------------------------------------------------------------------

def test_every_ckptd_command_and_flag_used_exists() -> None:
    invocations = list(_invocations())
    assert any(argv[1:2] == ["daemon"] for argv, _, exact in invocations if exact)
    assert any(argv[1:2] == ["launch"] for argv, _, exact in invocations if exact)
    problems = [problem for argv, where, exact in invocations
                for problem in _invocation_problems(argv, where, exact=exact)]
    assert not problems, "\n".join(problems)


def test_every_ckptd_variable_set_is_read_by_ckptd() -> None:
    variables = [(name, where) for name, where in _variables_set() if name.startswith("CKPTD_")]
    assert any(name == "CKPTD_DAEMON_LISTEN" for name, _ in variables)
    unknown = [f"{where}: {name}" for name, where in variables if not _known_variable(name)]
    assert not unknown, "ckptd reads none of these variables:\n" + "\n".join(unknown)


def test_example_config_names_every_daemon_option() -> None:
    text = EXAMPLE_TOML.read_text()
    top, _, roots = text.partition("\n[[roots]]\n")
    assert roots, "the example has no [[roots]] table"

    def keys(section: str) -> set[str]:
        return set(re.findall(r"^#? ?([a-z][a-z0-9_]*) = ", section, re.MULTILINE))

    flags = set(_options(_help("daemon"))) - COMMAND_FLAGS
    expected_top = {flag[2:].replace("-", "_") for flag in flags - ROOT_FLAGS if flag.startswith("--")}
    expected_roots = {flag[2:].replace("-", "_") for flag in ROOT_FLAGS - {"--s3-endpoint-url"}} | {"endpoint_url"}
    assert expected_top - keys(top) == set(), "options of `ckptd daemon --help` missing in the example"
    assert expected_roots - keys(roots) == set(), "root options missing in the example's [[roots]] table"
    document = tomllib.loads(text)
    assert set(document) - {"roots"} <= expected_top, "the example sets a key `ckptd daemon` does not have"


def _moved(text: str, base: Path) -> str:
    """``text`` with the deploy files' host paths moved under ``base``."""
    for host in HOST_PATHS:
        text = re.sub(rf"{re.escape(host)}(?=[/\"\s]|$)", str(base) + host, text, flags=re.MULTILINE)
    return text


def _check_config(config_text: str, tmp_path: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "daemon.toml"
    config.write_text(_moved(config_text, tmp_path))
    env = {key: value for key, value in os.environ.items() if not key.startswith("CKPTD_")}
    env.update({key: _moved(value, tmp_path) for key, value in environ.items()})
    return subprocess.run([CKPTD, "daemon", "--config", str(config), "--check-config"], capture_output=True,
                          text=True, timeout=60, env=env)


def _token_file(tmp_path: Path, path: str) -> None:
    moved = Path(_moved(path, tmp_path))
    moved.parent.mkdir(parents=True, exist_ok=True)
    moved.write_text("0123456789abcdef0123456789abcdef\n")


def _assert_one_good_line(done: subprocess.CompletedProcess[str], what: str) -> None:
    assert done.returncode == 0, f"{what}: `ckptd daemon --check-config` exited {done.returncode}: " \
                                 f"{(done.stderr or done.stdout).strip()}"
    assert len(done.stdout.strip().splitlines()) == 1, done.stdout


def test_example_config_passes_check_config(tmp_path: Path) -> None:
    text = EXAMPLE_TOML.read_text()
    _assert_one_good_line(_check_config(text, tmp_path, {}), EXAMPLE_TOML.name)
    refused = _check_config("no_such_option = 1\n" + text, tmp_path, {})
    assert refused.returncode != 0 and "no_such_option" in refused.stderr, "--check-config checks nothing"


def test_configmap_config_passes_check_config_with_the_daemonsets_environment(tmp_path: Path) -> None:
    config = _configmap_toml()
    _token_file(tmp_path, config["peer_token_file"])
    environ = {"CKPTD_DAEMON_NODE_ID": "node-a", "CKPTD_DAEMON_LISTEN": "10.1.2.3:9470"}  # as the DaemonSet sets
    text = _by_kind("ConfigMap", "ckptd-config")["data"]["daemon.toml"]
    _assert_one_good_line(_check_config(text, tmp_path, environ), "configmap.yaml")
    (tmp_path / "etc/ckptd-peer/token").unlink()
    refused = _check_config(text, tmp_path, environ)
    assert refused.returncode != 0, "a pod-IP listen without its peer token was accepted"


def test_systemd_environment_file_passes_check_config(tmp_path: Path) -> None:
    environ = dict(re.findall(r"^(CKPTD_[A-Z0-9_]+)=(.*)$", ENV_EXAMPLE.read_text(), re.MULTILINE))
    assert {"CKPTD_DAEMON_LISTEN", "CKPTD_DAEMON_BUDDY", "CKPTD_DAEMON_NODE_ID"} <= set(environ)
    unit_env = dict(re.findall(r"^Environment=(CKPTD_[A-Z0-9_]+)=(.*)$", UNIT.read_text(), re.MULTILINE))
    credential = re.search(r"^LoadCredential=([\w-]+):", UNIT.read_text(), re.MULTILINE)
    assert credential and unit_env["CKPTD_DAEMON_PEER_TOKEN_FILE"] == f"%d/{credential.group(1)}"
    _token_file(tmp_path, "/etc/ckptd/peer-token")
    environ["CKPTD_DAEMON_PEER_TOKEN_FILE"] = "/etc/ckptd/peer-token"  # where systemd's %d/peer-token comes from
    _assert_one_good_line(_check_config(EXAMPLE_TOML.read_text(), tmp_path, environ), ENV_EXAMPLE.name)


# --- systemd ------------------------------------------------------------------------------------------

def _installed_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart= pointing at this environment's ckptd (verify checks that it exists)."""
    text = UNIT.read_text()
    executable = shlex.split(re.search(r"^ExecStart=(.*)$", text, re.MULTILINE).group(1))[0]
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(executable, CKPTD))
    return unit


def test_systemd_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the unit is not verified here")
    text = UNIT.read_text()
    directives = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))
    assert directives["ProtectSystem"] == "strict" and directives["NoNewPrivileges"] == "yes"
    assert directives["PrivateTmp"] == "yes" and directives["KillSignal"] == "SIGTERM"
    assert directives["Restart"] == "on-failure" and ("DynamicUser" in directives or "User" in directives)
    drain = tomllib.loads(EXAMPLE_TOML.read_text()).get("drain_timeout_s", 30)
    assert float(directives["TimeoutStopSec"].removesuffix("s")) > drain, "systemd would SIGKILL mid-drain"
    example = tomllib.loads(EXAMPLE_TOML.read_text())
    writable = directives["ReadWritePaths"].split()
    for needed in (example["state_dir"], *(root["local"] for root in example["roots"])):
        assert any(Path(needed).is_relative_to(path) for path in writable), f"{needed} is not in ReadWritePaths="
    unit = _installed_unit(tmp_path)
    verified = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (verified.stdout + verified.stderr).splitlines() if unit.name in line]
    assert verified.returncode == 0 and not complaints, "\n".join(complaints) or verified.stderr
    scored = subprocess.run([analyze, "security", "--offline=yes", "--threshold=25", "--no-pager", str(unit)],
                            capture_output=True, text=True, timeout=60)
    if "--offline" in scored.stderr:
        pytest.skip(f"this systemd-analyze cannot score a unit file offline: {scored.stderr.strip()}")
    assert scored.returncode == 0, f"exposure above 2.5:\n{scored.stdout[-2000:]}"


# --- the container image ------------------------------------------------------------------------------

def _context_files() -> set[str]:
    """Files of the repository docker would send as the build context, .dockerignore applied (later
    patterns win; a pattern that matches a parent directory matches what is in it)."""
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated, pattern = line.startswith("!"), line.lstrip("!").strip("/")
            regex = re.escape(pattern).replace(r"\*\*", ".*").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            rules.append((negated, pattern, re.compile(regex + "$")))

    def excluded(relative: str) -> bool:
        parts = relative.split("/")
        prefixes = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
        verdict = False
        for negated, _, regex in rules:
            if any(regex.match(prefix) for prefix in prefixes):
                verdict = not negated
        return verdict

    kept = set()
    for directory, subdirectories, files in os.walk(REPO):
        base = Path(directory).relative_to(REPO).as_posix().removeprefix(".")
        prefix = base + "/" if base else ""
        subdirectories[:] = [name for name in subdirectories if not excluded(prefix + name) or any(
            negated and pattern.startswith(prefix + name + "/") for negated, pattern, _ in rules)]
        kept.update(prefix + name for name in files if not excluded(prefix + name))
    return kept


def test_dockerfile_runs_ckptd_as_non_root_with_the_pinned_torch() -> None:
    text = DOCKERFILE.read_text()
    assert _dockerfile_instruction("ENTRYPOINT") == ["ckptd"]
    assert _dockerfile_instruction("CMD") == ["daemon", "--config", "/etc/ckptd/daemon.toml"]
    users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
    uid = re.search(r"^ARG CKPTD_UID=(\d+)$", text, re.MULTILINE)
    assert users == ["${CKPTD_UID}:${CKPTD_UID}"] and uid and int(uid.group(1)) >= 1000, \
        "the image must end on a fixed, numeric, non-root user (runAsNonRoot checks it)"
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.MULTILINE)
    for install in re.findall(r"pip install [^\n&]*", text):
        for requirement in re.findall(r"\"?(torch[^\"\s]*)", install):
            assert requirement == "torch==${TORCH_VERSION}", f"unpinned torch in: {install}"
    assert '"/src[s3,daemon]"' in text
    user = _by_kind("DaemonSet")["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert user == int(uid.group(1)), "the DaemonSet runs as another UID than the image's user"


#: Dockerfile instructions, and variables the python base image's environment defines.
_DOCKER_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                        "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
_BASE_IMAGE_ENV = {"PATH", "LANG", "GPG_KEY", "PYTHON_VERSION", "PYTHON_SHA256"}


def _dockerfile_lines() -> list[tuple[str, str]]:
    """(instruction, arguments) of each instruction, continuation lines joined, comments dropped."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword, arguments.strip()))
            pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def test_dockerfile_parses_and_each_stage_declares_the_variables_it_uses() -> None:
    instructions = _dockerfile_lines()
    assert {keyword for keyword, _ in instructions} <= _DOCKER_INSTRUCTIONS
    global_args: set[str] = set()
    stage: set[str] | None = None
    for keyword, arguments in instructions:
        used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", arguments))
        if keyword == "FROM":
            assert used <= global_args, f"FROM {arguments} uses an ARG not declared before the first FROM"
            stage = set(_BASE_IMAGE_ENV)
            continue
        if stage is None:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            global_args.add(arguments.split("=")[0])
            continue
        assert used <= stage, f"{keyword} {arguments[:60]} uses {sorted(used - stage)}, not declared in its stage"
        if keyword == "ARG":
            stage.add(arguments.split("=")[0])
        elif keyword == "ENV":
            stage.update(re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", arguments))
        elif keyword in ("ENTRYPOINT", "CMD"):
            assert isinstance(json.loads(arguments), list), f"{keyword} must be the exec (JSON) form"
    assert stage is not None, "the Dockerfile has no FROM"


def test_build_context_holds_what_the_image_installs(tmp_path: Path) -> None:
    context = _context_files()
    assert not {path for path in context if path.split("/")[0] in {".venv", ".git", "tests", "benchmarks"}}
    assert not {path for path in context if "__pycache__" in path or path.endswith(".egg-info")}
    copied = [source for line in DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")
              and "--from=" not in line for source in line.split()[1:-1]]
    for source in copied:
        assert any(path == source or path.startswith(source + "/") for path in context), \
            f"the Dockerfile copies {source}, which .dockerignore keeps out of the build context"
    tree = tmp_path / "context"
    for relative in context:
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, tree / relative)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path / "wheels"), str(tree)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheels").glob("ckptd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ckptd/cli/main.py", "ckptd/daemon/__init__.py", "ckptd/cli/daemon_cmd.py"} <= names
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    extras = re.findall(r"^Provides-Extra: (\S+)$", zipfile.ZipFile(wheel).read(metadata).decode(), re.MULTILINE)
    assert {"s3", "daemon"} <= set(extras)


def _container_engine() -> str | None:
    for engine in ("docker", "podman"):
        path = shutil.which(engine)
        if path and subprocess.run([path, "info"], capture_output=True, timeout=30).returncode == 0:
            return path
    return None


@pytest.mark.slow
def test_image_builds_and_runs_as_its_user() -> None:
    engine = _container_engine()
    if engine is None:
        pytest.skip("no container engine answers (`docker info` / `podman info` failed): the image is not built")
    tag = f"ckptd-test:{os.getpid()}"
    built = subprocess.run([engine, "build", "-f", str(DOCKERFILE), "-t", tag, str(REPO)], capture_output=True,
                           text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-3000:]
    try:
        helped = subprocess.run([engine, "run", "--rm", "--read-only", tag, "daemon", "--help"],
                                capture_output=True, text=True, timeout=300)
        assert helped.returncode == 0 and "--check-config" in helped.stdout, helped.stderr
        who = subprocess.run([engine, "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True,
                             text=True, timeout=300)
        assert who.stdout.strip() == "10001"
    finally:
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=300)


# --- the deployed configuration, run for real ---------------------------------------------------------

@functools.cache
def _read_only_root() -> list[str] | None:
    """A command prefix that runs its command with the root file system read-only but /tmp (the pods'
    ``readOnlyRootFilesystem`` with an emptyDir on /tmp), or None where this machine cannot (a private
    mount namespace needs root with CAP_SYS_ADMIN)."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return None
    script = 'mount --bind /tmp /tmp && mount -o remount,bind,ro / && exec "$@"'
    prefix = [unshare, "--mount", "--propagation", "private", "sh", "-c", script, "read-only-root"]
    probe = subprocess.run([*prefix, "sh", "-c", "! test -w /usr && test -w /tmp"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else None


class _DeployedDaemon:
    """The daemon as the image starts it (ENTRYPOINT + the DaemonSet's args, config path moved), optionally
    under :func:`_read_only_root`; its log in a file."""

    def __init__(self, config: Path, state_dir: Path, env: dict[str, str], prefix: list[str]) -> None:
        args = next(container for container in _pod_spec(_by_kind("DaemonSet"))["containers"]
                    if container["name"] == "daemon")["args"]
        argv = [CKPTD, *_dockerfile_instruction("ENTRYPOINT")[1:], *args]
        argv[argv.index("--config") + 1] = str(config)
        self.state_dir, self.log_path = state_dir, config.with_suffix(".log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([*prefix, *argv], stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_started(self) -> str:
        """The daemon's HTTP base URL, once its daemon.json names this process."""
        def started() -> str | None:
            assert self.process.poll() is None, f"the daemon exited with {self.process.returncode}:\n{self.log()}"
            try:
                state = json.loads((self.state_dir / "daemon.json").read_text())
            except (OSError, ValueError):
                return None
            return f"http://{state['http']}" if state.get("pid") == self.process.pid else None
        return wait_until(started, 60, "the daemon to start")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""
    except urllib.error.URLError:
        return 0, b""


@pytest.mark.s3
def test_deployed_daemon_answers_its_probes_and_promotes_what_the_example_job_commits(
        tmp_path: Path, s3_server, s3_bucket: str) -> None:
    """The ConfigMap's TOML and the DaemonSet's environment start a real daemon (the pod IP stood in for by
    127.0.0.1, host paths moved under tmp_path, the bucket by moto's); its probe paths answer 200; the
    example train.py under ``ckptd launch`` with the Job's environment hands its commits to it over the
    configured socket, resumes from its own checkpoint when run again, and the daemon promotes every step.
    Where this machine allows it (root, unshare), daemon and trainers see a read-only root file system but
    /tmp, as in their pods (readOnlyRootFilesystem); elsewhere a writable one."""
    prefix = _read_only_root() or []
    config = _configmap_toml()
    (root,) = config["roots"]
    remote = f"s3://{s3_bucket}/ckpt/run1"
    daemon_toml = tmp_path / "daemon.toml"
    daemon_toml.write_text(_moved(_by_kind("ConfigMap", "ckptd-config")["data"]["daemon.toml"], tmp_path)
                           .replace(root["remote"], remote))
    _token_file(tmp_path, config["peer_token_file"])
    base = {key: value for key, value in os.environ.items() if not key.startswith("CKPTD_")}
    base.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                CKPTD_S3_ENDPOINT_URL=s3_server.endpoint_url, HOME=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    daemon_pod = _pod_spec(_by_kind("DaemonSet"))
    (container,) = [container for container in daemon_pod["containers"] if container["name"] == "daemon"]
    # this test runs as one user, both pods as UID 10001 (checked above): let this user on the socket
    daemon_env = {"CKPTD_DAEMON_NODE_ID": "node-a", "CKPTD_DAEMON_LISTEN": "127.0.0.1:0",
                  "CKPTD_DAEMON_CONTROL_ALLOWED_UIDS": str(os.geteuid()),
                  "CKPTD_DAEMON_LOCAL_DISK": "any"}  # here the moved host paths share one disk
    assert set(daemon_env) >= {name for name in _env(container) if name.startswith("CKPTD_")}
    state_dir = Path(_moved(config["state_dir"], tmp_path))
    script = tmp_path / "train.py"
    script.write_text(_by_kind("ConfigMap", "ckpt-train-script")["data"]["train.py"])
    (trainer,) = _pod_spec(_by_kind("Job"))["containers"]
    trainer_env = {name: _moved(value, tmp_path) for name, value in _env(trainer).items() if value}
    trainer_env.update(CKPT_REMOTE=remote, CKPT_EVERY="5")
    daemon = _DeployedDaemon(daemon_toml, state_dir, {**base, **daemon_env}, prefix)
    try:
        http = daemon.wait_started()
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = container[probe]["httpGet"]["path"]
            wait_until(lambda: _get(http + path)[0] == 200, 60, f"{path} to answer 200")
        for steps in (10, 15):  # the second run resumes: one that did not would save step 5 again, refused
            done = subprocess.run([*prefix, CKPTD, "launch", "--nproc-per-node", "1", str(script)],
                                  capture_output=True, text=True, timeout=180, cwd=tmp_path,
                                  env={**base, **trainer_env, "TRAIN_STEPS": str(steps)})
            assert done.returncode == 0, done.stderr[-3000:]

        def status() -> dict[str, Any]:
            code, body = _get(http + "/status")
            assert code == 200, f"/status answered {code}"
            return json.loads(body)["roots"][root["name"]]

        wait_until(lambda: status()["tiers"]["object"]["steps"] == [5, 10, 15], 60,
                   "the daemon to promote steps 5, 10 and 15")
        assert status()["trainer_report"], "the trainer never reached the daemon's socket"
        assert daemon.stop() == 0, daemon.log()
    finally:
        if daemon.process.poll() is None:
            daemon.process.kill()
            daemon.process.wait(30)
    assert "Read-only file system" not in daemon.log()
    listed = subprocess.run([CKPTD, "ls", "--json", remote, "--endpoint-url", s3_server.endpoint_url],
                            capture_output=True, text=True, timeout=120, env=base)
    assert listed.returncode == 0, listed.stderr
    assert [entry["step"] for entry in json.loads(listed.stdout) if entry["state"] == "committed"] == [5, 10, 15]
