"""Dashboards, alerts and the hardened deploy files (deploy/monitoring, deploy/kubernetes, deploy/systemd,
deploy/Dockerfile).

- Alerting rules: every alert the daemon's operators need (lag, outage, stalls, pin cap, verify failures,
  scrub findings, degraded tiers) exists with a severity, a summary, a description and a runbook section in
  docs/daemon.md; every metric a rule or a dashboard panel reads is one the daemon exports; the
  PrometheusRule manifest holds exactly the plain rules file's groups; ``promtool check rules`` and
  ``promtool test rules`` (a unit test per alert) pass where promtool is installed (the Debian package
  ``prometheus`` ships it; skipped, saying so, elsewhere).
- Deploy: a NetworkPolicy lets only the daemons, the training pods and the monitoring namespace reach the
  daemon's port; the DaemonSet has a priority class that exists; the NVMe hostPath must exist (type
  Directory) and the daemon refuses a root on the state dir's disk; the systemd unit does not restart on a
  configuration error and has a memory ceiling; the base image is pinned by digest.
"""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ckptd.daemon.config import load_config
from ckptd.daemon.metrics import DaemonMetrics
from ckptd.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
MONITORING = DEPLOY / "monitoring"
K8S = DEPLOY / "kubernetes"
RULES = MONITORING / "ckptd-rules.yaml"
RULE_TESTS = MONITORING / "ckptd-rules.test.yaml"
#: What the alerts must cover: alert name -> the metric it reads.
REQUIRED_ALERTS = {
    "CkptdObjectTierUnreachable": "ckptd_tier_degraded", "CkptdPromotionLagging": "ckptd_promotion_lag_seconds",
    "CkptdPromotionStalled": "ckptd_journal_depth", "CkptdPinCapSkippingSteps": "ckptd_pin_cap_skipped_steps_total",
    "CkptdVerifyFailures": "ckptd_verify_failures_total", "CkptdScrubFoundBadChunks": "ckptd_scrub_failures_total",
    "CkptdScrubCouldNotRepair": "ckptd_errors_total", "CkptdLocalTierDegraded": "ckptd_tier_degraded",
    "CkptdPeerTierDegraded": "ckptd_tier_degraded", "CkptdUpkeepStalled": "ckptd_upkeep_last_pass_timestamp_seconds",
}
_PROMQL_WORDS = {"by", "on", "unless", "and", "or", "max", "sum", "min", "rate", "increase", "time", "le",
                 "histogram_quantile", "label_values", "without", "ignoring", "group_left", "offset"}


def _exported() -> set[str]:
    """Every sample name the daemon's /metrics can hold."""
    names = set()
    for family in DaemonMetrics().registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def _metrics_in(expr: str) -> set[str]:
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "", without_strings)
    return {word for word in re.findall(r"[a-z_][a-z0-9_]*", without_labels) if word.startswith("ckptd_")}


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_needed_alert_exists_reads_exported_metrics_and_has_a_runbook() -> None:
    exported, docs = _exported(), (REPO / "docs" / "daemon.md").read_text()
    rules = {rule["alert"]: rule for rule in _rules()}
    assert set(REQUIRED_ALERTS) <= set(rules), set(REQUIRED_ALERTS) - set(rules)
    for name, rule in rules.items():
        used = _metrics_in(rule["expr"])
        assert used and used <= exported, f"{name} reads metrics the daemon does not export: {used - exported}"
        if name in REQUIRED_ALERTS:
            assert REQUIRED_ALERTS[name] in used, name
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name
        assert f"`{name}`" in docs, f"docs/daemon.md has no runbook entry for {name}"


def test_the_prometheusrule_holds_exactly_the_rules_file() -> None:
    (manifest,) = [document for document in yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
                   if document]
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1" and manifest["kind"] == "PrometheusRule"
    assert manifest["metadata"]["namespace"] == "ckptd"
    assert manifest["spec"] == yaml.safe_load(RULES.read_text())


def test_promtool_checks_the_rules_and_every_alerts_unit_test_passes() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian/Ubuntu: apt-get install prometheus); the rules' syntax and "
                    "their unit tests are not run here")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], capture_output=True, text=True,
                            timeout=300, cwd=MONITORING)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested_alerts = {case["alertname"] for test in tests for case in test["alert_rule_test"]}
    assert tested_alerts == {rule["alert"] for rule in _rules()}, "every alert has a unit test"
    for test in tests:
        expectations = [bool(case["exp_alerts"]) for case in test["alert_rule_test"]]
        assert True in expectations and False in expectations, "each test shows the alert quiet, then firing"


def test_the_dashboard_reads_only_exported_metrics_and_shows_what_the_alerts_watch() -> None:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    exported, shown = _exported(), set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = _metrics_in(target["expr"])
            assert used and used <= exported, f"{panel['title']}: {used - exported}"
            shown |= used
    assert set(REQUIRED_ALERTS.values()) <= shown, set(REQUIRED_ALERTS.values()) - shown
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_pod_monitor_scrapes_the_daemons_with_the_scrape_token() -> None:
    (monitor,) = [document for document in yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text())
                  if document]
    daemonset = _manifest("daemonset.yaml")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        daemonset["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = [port["name"] for container in daemonset["spec"]["template"]["spec"]["containers"]
             for port in container.get("ports", [])]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["type"] == "Bearer", "off loopback /metrics needs the scrape token"
    assert "--print-token scrape" in (MONITORING / "podmonitor.yaml").read_text()


# --- deploy hardening ---------------------------------------------------------------------------------------
def _manifest(name: str) -> dict[str, Any]:
    (document,) = [document for document in yaml.safe_load_all((K8S / name).read_text()) if document]
    return document


def test_the_network_policy_admits_only_daemons_trainers_and_monitoring() -> None:
    policy, daemonset, job = _manifest("networkpolicy.yaml"), _manifest("daemonset.yaml"), None
    for document in yaml.safe_load_all((K8S / "training-job.yaml").read_text()):
        if document and document["kind"] == "Job":
            job = document
    assert job is not None
    kubernetes_validate.validate(policy, kubernetes_validate.utils.latest_version(), strict=True)
    daemon_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    trainer_labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= daemon_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (daemon,) = [container for container in daemonset["spec"]["template"]["spec"]["containers"]
                 if container["name"] == "daemon"]
    port = daemon["ports"][0]["containerPort"]
    sources = []
    for rule in policy["spec"]["ingress"]:
        assert [entry["port"] for entry in rule["ports"]] == [port]
        sources += rule["from"]
    pods = [source["podSelector"]["matchLabels"] for source in sources if "podSelector" in source]
    namespaces = [source["namespaceSelector"]["matchLabels"] for source in sources if "namespaceSelector" in source]
    assert any(labels.items() <= daemon_labels.items() for labels in pods), "daemons reach their buddies"
    assert any(labels.items() <= trainer_labels.items() for labels in pods), "trainers restore from peers"
    assert namespaces == [{"kubernetes.io/metadata.name": "monitoring"}]
    assert all("ipBlock" not in source for source in sources), "no address range is let in"


def test_the_daemonset_has_a_priority_class_and_an_nvme_that_must_exist() -> None:
    daemonset, priority = _manifest("daemonset.yaml"), _manifest("priorityclass.yaml")
    kubernetes_validate.validate(priority, kubernetes_validate.utils.latest_version(), strict=True)
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    assert 0 < priority["value"] < 2_000_000_000 and priority["globalDefault"] is False
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (daemon,) = [container for container in pod["containers"] if container["name"] == "daemon"]
    nvme = next(mount["name"] for mount in daemon["volumeMounts"] if mount["mountPath"] == "/nvme/ckpt")
    assert volumes[nvme]["hostPath"]["type"] == "Directory", "an unmounted NVMe must not become a root-disk directory"
    env = {item["name"]: item.get("value") for item in daemon["env"]}
    assert env["CKPTD_DAEMON_LOCAL_DISK"] == "separate"


def test_a_root_on_the_state_dirs_disk_is_refused_when_a_disk_of_its_own_is_asked_for(tmp_path: Path) -> None:
    values = {"state_dir": str(tmp_path / "state"), "local": str(tmp_path / "root")}
    with pytest.raises(ConfigError, match="not mounted") as caught:
        load_config(None, {**values, "local_disk": "separate"}, {})
    assert "local_disk" in caught.value.hint
    with pytest.raises(ConfigError, match="CKPTD_DAEMON_LOCAL_DISK"):
        load_config(None, values, {"CKPTD_DAEMON_LOCAL_DISK": "separate"})
    assert load_config(None, values, {}).local_disk == "any"


def test_the_systemd_unit_stops_on_config_errors_and_has_a_memory_ceiling() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment, method-assign]
    unit.read_string((DEPLOY / "systemd" / "ckptd-daemon.service").read_text())
    service = unit["Service"]
    assert str(ConfigError.exit_code) in service["RestartPreventExitStatus"].split()
    assert re.fullmatch(r"\d+[KMGT]?", service["MemoryMax"])
    assert service["Restart"] == "on-failure"


def test_the_base_image_is_pinned_by_digest() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    arguments = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    images = [re.sub(r"\$\{(\w+)\}", lambda match: arguments[match.group(1)], line.split()[1])
              for line in text.splitlines() if line.startswith("FROM ")]
    assert images and all(re.search(r"@sha256:[0-9a-f]{64}$", image) for image in images), images
    assert "docker inspect" in text or "imagetools inspect" in text, "the Dockerfile says how to update the digest"
