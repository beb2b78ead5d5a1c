"""``ckptd plan`` on the command line: the JSON schema, the table, the failure options, bad input (exit 2) and
``--measure`` against a real directory and moto's S3 server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckptd.cli.main import cli

LLAMA2_7B = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "vocab_size": 32000,
             "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False}

#: Every key of schema 2, level by level (see ckptd.planning.plan).
SCHEMA_KEYS = {
    "": {"schema", "inputs", "run", "checkpoint", "rank", "node", "stages", "staging", "object_store", "tiers",
         "warnings"},
    "inputs": {"parameters", "expert_parameters", "parameters_from", "bytes_per_parameter", "state_preset", "presets",
               "layout", "dedup", "replicas", "replicas_from", "directories", "bandwidths_gb_per_s",
               "bandwidth_sources", "object_store_limit_gb_per_s", "retention", "failures"},
    "inputs.bytes_per_parameter": {"weights", "grads", "master", "moments", "total"},
    "inputs.layout": {"tp", "pp", "dp", "ep", "zero_stage", "gpus_per_node", "world_size", "nodes"},
    "inputs.bandwidths_gb_per_s": {"d2h", "host_memcpy", "disk", "peer", "object", "object_job"},
    "inputs.bandwidth_sources": {"d2h", "host_memcpy", "disk", "peer", "object", "object_job"},
    "inputs.retention": {"keep_local", "keep_peer", "keep_remote"},
    "inputs.failures": {"mtbf_hours", "mtbf_from", "per_gpu_failures_per_hour", "restart_s"},
    "checkpoint": {"unique_bytes", "held_bytes_all_ranks", "replication_factor", "written_bytes_all_nodes"},
    "checkpoint.unique_bytes": {"weights", "grads", "master", "moments", "total"},
    "rank": {"busiest", "held_bytes", "written_bytes", "mean_written_bytes"},
    "node": {"busiest", "held_bytes", "written_bytes", "distinct_held_bytes", "restore_own_directory_bytes",
             "restore_elsewhere_bytes"},
    "staging": {"seconds", "bound"},
    "object_store": {"assumed_job_gb_per_s", "limit_gb_per_s", "beyond_limit"},
    "tiers": {"local", "peer", "object"},
    "tiers.local": {"write_seconds", "durable_seconds", "restore_seconds", "restore_from", "restorable_seconds",
                    "storage_bytes_per_node", "peak_bytes_per_node", "storage_bytes_total", "bytes_per_save",
                    "interval", "lost_fraction", "goodput", "run", "sync"},
    "tiers.local.sync": {"stall_seconds", "interval", "lost_fraction", "goodput", "run"},
    "tiers.local.interval": {"young_seconds", "daly_seconds", "seconds", "formula", "bound"},
    "tiers.local.lost_fraction": {"overhead", "recompute", "restart", "total"},
}


def _run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, ["plan", *args], env=env)


def _json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = _run(*args, "--json", env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_json_schema_is_stable():
    document = _json("--params", "70e9", "--tp", "8", "--pp", "4", "--dp", "4", "--zero-stage", "1")
    assert document["schema"] == 2
    for path, keys in SCHEMA_KEYS.items():
        node = document
        for part in filter(None, path.split(".")):
            node = node[part]
        assert set(node) == keys, path
    assert set(document["stages"][0]) == {"stage", "parameters", "expert_parameters", "rank_held_bytes",
                                          "rank_written_bytes"}
    assert len(document["stages"]) == 4
    assert document["tiers"]["local"]["interval"]["formula"] == "daly"
    assert set(document["tiers"]["object"]) == SCHEMA_KEYS["tiers.local"]


def test_70b_at_16_bytes_and_zero_1_on_the_command_line():
    document = _json("--params", "70e9", "--dp", "8", "--zero-stage", "1", "--state", "adam-mixed", "--no-dedup")
    assert document["checkpoint"]["unique_bytes"]["total"] == 1_120_000_000_000
    assert document["rank"]["held_bytes"] == {"weights": 140 * 10**9, "grads": 140 * 10**9, "master": 35 * 10**9,
                                              "moments": 70 * 10**9, "total": 385 * 10**9}
    assert document["inputs"]["layout"]["world_size"] == 8 and document["inputs"]["layout"]["nodes"] == 1
    deduplicated = _json("--params", "70B", "--dp", "8", "--keep-local", "2", "--keep-remote", "5", "--state",
                         "adam-mixed")
    assert deduplicated["rank"]["written_bytes"]["total"] == deduplicated["rank"]["mean_written_bytes"] == 140 * 10**9
    tiers = deduplicated["tiers"]
    assert tiers["local"]["storage_bytes_per_node"] == 2 * 1_120 * 10**9  # one node holds every rank's share
    assert tiers["local"]["peak_bytes_per_node"] == 3 * 1_120 * 10**9
    assert tiers["object"]["storage_bytes_total"] == 5 * 1_120 * 10**9 and tiers["object"]["storage_bytes_per_node"] is None


def test_state_bytes_and_presets():
    no_grads = _json("--params", "1e9", "--state", "adam-mixed-no-grads")
    assert no_grads["checkpoint"]["unique_bytes"]["total"] == 14 * 10**9
    with_grads = _json("--params", "1e9", "--grad-bytes", "4")["inputs"]
    assert with_grads["bytes_per_parameter"]["total"] == 16 and with_grads["state_preset"] is None


def test_a_config_is_counted_and_staged_by_layers(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA2_7B))
    document = _json("--config", str(config), "--pp", "4", "--gpus-per-node", "4")
    assert document["inputs"]["parameters"] == 6_738_415_616
    assert document["inputs"]["parameters_from"] == f"config {config}"
    assert [stage["parameters"] for stage in document["stages"]] == [1_750_138_880, 1_619_066_880, 1_619_066_880,
                                                                     1_750_142_976]
    assert document["rank"]["busiest"] == 3
    toml = tmp_path / "model.toml"
    toml.write_text("\n".join(f"{key} = {json.dumps(value).lower()}" for key, value in LLAMA2_7B.items()))
    assert _json("--config", str(toml), "--tied-embeddings")["inputs"]["parameters"] == 6_738_415_616 - 32000 * 4096


def test_mtbf_from_a_fleet_record_for_this_jobs_gpus():
    document = _json("--params", "70e9", "--tp", "8", "--dp", "128", "--failures", "419", "--days", "54",
                     "--gpus", "16384")
    failures = document["inputs"]["failures"]
    assert failures["mtbf_from"] == "failures"
    assert failures["per_gpu_failures_per_hour"] == pytest.approx(419 / (54 * 24 * 16384))
    assert failures["mtbf_hours"] == pytest.approx(54 * 24 / 419 * 16)  # 1024 of the fleet's 16384 GPUs
    given = _json("--params", "70e9", "--mtbf-hours", "12")["inputs"]["failures"]
    assert given == {"mtbf_hours": 12.0, "mtbf_from": "given", "per_gpu_failures_per_hour": None, "restart_s": 600.0}


def test_warnings_say_what_the_plan_cannot_see():
    warnings = _json("--params", "70e9", "--pp", "4", "--dp", "8", "--ep", "4", "--no-dedup")["warnings"]
    assert any("spreads the parameters evenly over pipeline stages" in warning for warning in warnings)
    assert any("--ep 4 splits no expert parameters" in warning for warning in warnings)
    assert any("with --replicas every-rank the nodes write 8.00x the unique bytes" in warning for warning in warnings)
    assert _json("--params", "7e9", "--dp", "8")["warnings"] == []


def test_given_bandwidths_win_and_say_so():
    document = _json("--params", "7e9", "--disk-gb-per-s", "2", env={"CKPTD_PLAN_OBJECT_GB_PER_S": "1"})
    sources = document["inputs"]["bandwidth_sources"]
    assert sources["disk"] == "given" and sources["object"] == "given" and sources["peer"] == "default"
    assert document["inputs"]["bandwidths_gb_per_s"]["object"] == 1.0
    assert document["tiers"]["local"]["write_seconds"] == pytest.approx(7e9 * 12 / 2e9)


def test_ckptd_plan_runs_without_torch():
    code = ("import sys; from click.testing import CliRunner; from ckptd.cli.main import cli; "
            "result = CliRunner().invoke(cli, ['plan', '--params', '70e9', '--tp', '8', '--json']); "
            "assert result.exit_code == 0, result.output; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", "the arithmetic needs neither torch nor numpy"


def test_the_table_for_people():
    result = _run("--params", "70e9", "--tp", "8", "--pp", "4", "--dp", "32", "--zero-stage", "1")
    assert result.exit_code == 0, result.output
    for says in ("840 GB", "staging stall", "local", "peer", "object", "MTBF 49.5 h", "1024 GPUs"):
        assert says in result.stdout, says


def test_replicas_presets_and_the_run_on_the_command_line():
    args = ("--params", "70e9", "--tp", "8", "--pp", "4", "--dp", "16", "--zero-stage", "1", "--state", "adam-mixed")
    default = _json(*args, "--tokens", "1.4T", "--tflops-per-gpu", "400")
    assert default["inputs"]["replicas"] == "once-per-directory" and default["inputs"]["replicas_from"] == "default"
    assert default["inputs"]["directories"] == "per-node" and default["inputs"]["state_preset"] == "adam-mixed"
    assert default["node"]["written_bytes"]["total"] == 83_125_000_000
    assert {name: preset["bytes_per_parameter"] for name, preset in default["inputs"]["presets"].items()} == {
        "fsdp2": 12, "megatron": 14, "deepspeed": 14, "adam-mixed": 16, "adam-mixed-no-grads": 14, "adam-fp32": 16,
        "sgd-momentum-mixed": 12}
    run = default["run"]
    assert run["from"] == "tokens" and run["tokens"] == 1.4e12 and run["flops_per_gpu"] == 400e12
    assert run["compute_days"] == pytest.approx(6 * 70e9 * 1.4e12 / (512 * 400e12) / 86400)  # 33.2 days
    local = default["tiers"]["local"]
    assert set(local["run"]) == {"saves", "bytes_written", "wall_days", "expected_failures", "lost_hours"}
    assert local["run"]["expected_failures"] == pytest.approx(8.1, abs=0.1)
    assert local["sync"]["stall_seconds"] == local["durable_seconds"]
    assert local["sync"]["run"]["saves"] < local["run"]["saves"]
    assert local["goodput"] == pytest.approx(1 - local["lost_fraction"]["total"])
    once = _json(*args, "--replicas", "once", "--run-days", "10")
    assert once["inputs"]["replicas_from"] == "given" and once["node"]["written_bytes"]["total"] == 17_500_000_000
    assert once["node"]["restore_elsewhere_bytes"] == 83_125_000_000 - 17_500_000_000
    assert once["tiers"]["local"]["restore_from"] == "own directory + object tier"
    assert once["run"]["compute_days"] == 10 and once["run"]["tokens"] is None
    assert _json("--params", "7e9")["run"] is None and _json("--params", "7e9")["tiers"]["object"]["run"] is None


def test_the_object_store_limit_warns_and_is_configurable():
    args = ("--params", "175e9", "--tp", "8", "--dp", "128")  # 128 nodes x 2.5 GB/s = 320 GB/s
    document = _json(*args)
    assert document["object_store"] == {"assumed_job_gb_per_s": 320.0, "limit_gb_per_s": 100.0, "beyond_limit": True}
    assert any("320 GB/s into the object store at once, beyond 100 GB/s" in warning for warning in document["warnings"])
    assert not _json(*args, "--object-store-limit-gb-per-s", "400")["object_store"]["beyond_limit"]
    assert _json(*args, env={"CKPTD_PLAN_OBJECT_STORE_LIMIT_GB_PER_S": "350"})["object_store"]["limit_gb_per_s"] == 350
    result = _run(*args)
    assert "warning: the plan assumes 128 node(s) x 2.5 GB/s" in " ".join(result.stdout.split())


def test_the_table_shows_async_and_sync_saves_and_the_presets():
    result = _run("--params", "70e9", "--tp", "8", "--pp", "4", "--dp", "16", "--zero-stage", "1", "--tokens", "1.4T",
                  "--tflops-per-gpu", "400")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    for says in ("--state fsdp2: 12 bytes each", "fsdp2 12, megatron 14, deepspeed 14, adam-mixed 16",
                 "replicas written once-per-directory (the manager's default)", "async (ckptd) and synchronous saves",
                 "33.2 days of compute", "own directory", "8.06 failures expected"):
        assert says in text, says
    rows = [line.replace("│", " ").replace("|", " ").split() for line in result.stdout.splitlines()]
    assert sum(row[1:2] == ["sync"] for row in rows) == 3 and sum(row[1:2] == ["async"] for row in rows) == 3


@pytest.mark.parametrize(("args", "says"), [
    (("--params", "7e9", "--tokens", "1T"), "--tokens needs --tflops-per-gpu"),
    (("--params", "7e9", "--tflops-per-gpu", "400"), "--tflops-per-gpu goes with --tokens"),
    (("--params", "7e9", "--tokens", "1T", "--tflops-per-gpu", "400", "--run-days", "3"),
     "give the run's length one way"),
    (("--params", "7e9", "--tokens", "lots", "--tflops-per-gpu", "400"), "--tokens: 'lots' is not a token count"),
    (("--params", "7e9", "--tokens", "1T", "--tflops-per-gpu", "0"), "--tflops-per-gpu must be a positive number"),
    (("--params", "7e9", "--run-days", "-1"), "--run-days must be a positive number"),
    (("--params", "7e9", "--no-dedup", "--replicas", "once"), "--no-dedup is the old name of --replicas every-rank"),
    (("--params", "7e9", "--object-store-limit-gb-per-s", "0"), "--object-store-limit-gb-per-s must be a positive"),
    (("--params", "-5"), "is not a parameter count"),
    (("--params", "70e9", "--tp", "-1"), "--tp must be a positive integer"),
    (("--params", "70e9", "--zero-stage", "5"), "unknown ZeRO stage 5"),
    (("--params", "70e9", "--world-size", "100", "--tp", "8"), "does not divide the world size 100"),
    (("--params", "70e9", "--world-size", "64", "--tp", "8", "--dp", "3"), "but the world size is 64"),
    (("--params", "70e9", "--dp", "6", "--ep", "4"), "--ep 4 does not divide --dp 6"),
    (("--params", "70e9", "--disk-gb-per-s", "-1"), "--disk-gb-per-s must be a positive number"),
    (("--params", "70e9", "--keep-remote", "-2"), "--keep-remote must be an integer >= 0"),
    (("--params", "70e9", "--mtbf-hours", "0"), "--mtbf-hours must be a positive number"),
    (("--params", "70e9", "--mtbf-hours", "3", "--failures", "10"), "give the failure rate one way"),
    (("--params", "70e9", "--failures", "10"), "--failures, --days and --gpus go together"),
    (("--params", "70e9", "--days", "-3", "--failures", "1", "--gpus", "8"), "--days must be a positive number"),
    ((), "exactly one of --params COUNT and --config FILE"),
    (("--params", "70e9", "--local", "."), "add --measure"),
    (("--params", "70e9", "--config", "config.json"), "exactly one of --params COUNT and --config FILE"),
    (("--params", "1e400"), "--params: '1e400' is more than ckptd plan counts"),
    (("--params", "70e9", "--expert-params", "1e400"), "--expert-params: '1e400' is more than"),
    (("--params", "70e9", "--weight-bytes", "inf"), "--weight-bytes must be a finite number >= 0"),
    (("--params", "70e9", "--restart-minutes", "-1"), "the restart time (--restart-minutes) must be"),
    (("--params", "70e9", "--measure", "--measure-mib", "100000"), "--measure-mib must be between 1 and 4096"),
    (("--params", "70e9", "--mtbf-hours", "3", "--days", "2"), "give the failure rate one way"),
])
def test_bad_input_exits_2_with_one_line(args, says):
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output


def test_bandwidth_flags_are_gigabytes_per_second():
    result = _run("--help")
    assert result.exit_code == 0
    for name in ("d2h", "host-memcpy", "disk", "peer", "object", "object-job"):
        assert f"--{name}-gb-per-s" in result.stdout, name
    assert "gbps" not in result.stdout.lower(), "Gbps reads as gigabits per second"
    assert "not gigabits" in " ".join(result.stdout.split())
    document = _json("--params", "1e9", "--peer-gb-per-s", "12.5", "--disk-gb-per-s", "100")
    assert document["inputs"]["bandwidths_gb_per_s"]["peer"] == 12.5
    assert document["tiers"]["peer"]["write_seconds"] == pytest.approx(12e9 / 12.5e9)  # 12.5e9 bytes/s


def test_host_memory_is_measured_by_parallel_copiers():
    from ckptd.planning.measure import host_memcpy_gbps

    assert host_memcpy_gbps(4 << 20, repeats=1, copiers=3) > 0  # shares of 1398101, 1398101, 1398102 bytes


def test_the_disk_probe_is_bounded_in_time_and_removed(tmp_path):
    from ckptd.planning.measure import disk_gbps

    assert disk_gbps(tmp_path, 1 << 30, deadline_s=0.0) > 0, "one 8 MiB piece, not the whole GiB"
    assert list(tmp_path.iterdir()) == []


def test_a_bad_config_file_is_named(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = _run("--config", str(broken))
    assert result.exit_code == 2 and "not valid JSON" in result.stderr and "broken.json" in result.stderr
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"hidden_size": 4096}))
    result = _run("--config", str(partial))
    assert result.exit_code == 2 and "missing num_attention_heads" in result.stderr
    assert "partial.json" in result.stderr
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps(LLAMA2_7B))
    result = _run("--config", str(llama), "--tp", "3")
    assert result.exit_code == 2 and "--tp 3 does not divide the model's 32 attention heads" in result.stderr


@pytest.mark.s3
def test_measure_here_writes_probes_and_removes_them(tmp_path, s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    local = tmp_path / "nvme"
    local.mkdir()
    document = _json("--params", "1e9", "--measure", "--local", str(local), "--measure-mib", "4",
                     "--measure-object", f"s3://{s3_bucket}/probe", "--endpoint-url", s3_server.endpoint_url,
                     "--region", "us-east-1", "--peer-gb-per-s", "7")
    sources, gbps = document["inputs"]["bandwidth_sources"], document["inputs"]["bandwidths_gb_per_s"]
    assert sources["host_memcpy"] == sources["disk"] == sources["object"] == "measured"
    assert sources["peer"] == "given" and gbps["peer"] == 7.0
    assert sources["d2h"] in {"measured", "default"}  # measured only where torch sees a CUDA device
    for name in ("host_memcpy", "disk", "object"):
        assert 0 < gbps[name] < 10_000, name
    assert document["tiers"]["local"]["write_seconds"] == pytest.approx(
        document["node"]["written_bytes"]["total"] / (gbps["disk"] * 1e9))
    assert list(local.iterdir()) == [], "the disk probe is removed"
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0, "the object probe is removed"
