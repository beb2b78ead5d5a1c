"""``ckptd plan`` against the manager's replica modes, the state presets, a run's length, synchronous saves and the
object-store limit (issue 32), each against figures computed by hand from the formulas in docs/plan.md."""

from __future__ import annotations

import math

import pytest

from ckptd.config import override
from ckptd.errors import ConfigError
from ckptd.planning import (PRESETS, Bandwidths, Layout, ParameterCount, PlanInputs, RunLength, default_replicas,
                            job_mtbf_hours, make_plan, split_checkpoint)

GB = 1e9
#: Llama 3 405B's pre-training: 419 unexpected interruptions in 54 days on 16384 GPUs.
LLAMA3_RATE = 419 / (54 * 24 * 16384)  # per GPU-hour


def _plan(params: float, layout: Layout, preset: str, *, replicas: str | None = None, directories: str = "per-node",
          run: RunLength | None = None, **options):
    mtbf_hours = options.pop("mtbf_hours", None) or job_mtbf_hours(419, 54, 16384, layout.world_size)
    return make_plan(PlanInputs(parameters=ParameterCount.flat(int(params)), parameters_from="--params",
                                state=PRESETS[preset], state_preset=preset, layout=layout, mtbf_hours=mtbf_hours,
                                replicas=replicas, directories=directories, run=run, **options))


# --- presets ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("preset", "components", "total"), [
    ("fsdp2", {"weights": 4, "grads": 0, "master": 0, "moments": 8}, 12),      # fp32 params + two moments
    ("megatron", {"weights": 2, "grads": 0, "master": 4, "moments": 8}, 14),   # bf16 + fp32 main + two moments
    ("deepspeed", {"weights": 2, "grads": 0, "master": 4, "moments": 8}, 14),  # ZeRO 1/2 module + optimizer files
    ("adam-mixed", {"weights": 2, "grads": 2, "master": 4, "moments": 8}, 16),
])
def test_each_preset_against_a_hand_computed_plan(preset, components, total):
    assert PRESETS[preset].as_dict() == components and PRESETS[preset].total == total
    # 7e9 parameters, tp 2 x dp 4 with ZeRO-1 on one node: one directory, so replicas are written once
    plan = _plan(7e9, Layout(tp=2, dp=4, zero_stage=1), preset)
    assert plan.replicas == "once"
    assert plan.split.unique.total == pytest.approx(7e9 * total)
    # a rank holds its TP half of the weights (and gradients) whole and a quarter of the master weights and moments
    held = 3.5e9 * (components["weights"] + components["grads"]) \
        + 3.5e9 / 4 * (components["master"] + components["moments"])
    assert plan.split.rank_held.total == pytest.approx(held)
    assert plan.split.rank_written.total == pytest.approx(7e9 * total / 8), "written once: an eighth each"
    assert plan.staging_s == pytest.approx(max(7e9 * total / 8 / 25e9, 7e9 * total / 80e9))
    assert plan.as_json()["inputs"]["presets"][preset]["bytes_per_parameter"] == total
    # tp 2 x dp 8 on two nodes (each node: tp 2 x dp 4): the manager's default writes, per node, both TP halves
    # of the replicated components once and its 8 ranks' shards (an eighth of a half each) of the sharded ones
    two_nodes = _plan(7e9, Layout(tp=2, dp=8, zero_stage=1), preset)
    assert two_nodes.replicas == "once-per-directory"
    node = 7e9 * (components["weights"] + components["grads"]) + 8 * 3.5e9 / 8 * (components["master"]
                                                                                 + components["moments"])
    assert two_nodes.split.node_written.total == pytest.approx(node)
    assert two_nodes.split.job_written == pytest.approx(2 * node)
    assert two_nodes.tiers["local"].storage_per_node == pytest.approx(2 * node)


def test_the_default_state_is_fsdp2s_twelve_bytes():
    from ckptd.planning import DEFAULT_PRESET, StateBytes

    assert DEFAULT_PRESET == "fsdp2" and StateBytes() == PRESETS["fsdp2"] and StateBytes().total == 12
    gpt3 = split_checkpoint(ParameterCount.flat(175 * 10**9).stages(1), PRESETS["adam-mixed"], Layout())
    assert gpt3.unique.total == 2.8e12, "GPT-3's 2.8 TB at 16 bytes per parameter"


# --- replica modes ------------------------------------------------------------------------------------------

def test_the_default_mode_is_the_managers():
    two_nodes = Layout(tp=2, dp=8)
    assert default_replicas(two_nodes, "per-node") == "once-per-directory"
    assert default_replicas(two_nodes, "per-rank") == "once-per-directory"
    assert default_replicas(two_nodes, "job-shared") == "once"
    assert default_replicas(Layout(dp=8), "per-node") == "once", "one node: one directory for the job"
    assert default_replicas(Layout(), "per-rank") == "once", "a single rank"
    with pytest.raises(ConfigError, match="--directories 'nfs' is not one of"):
        default_replicas(two_nodes, "nfs")


# 1e9 parameters at Megatron's 14 bytes on tp 2 x dp 8, ZeRO-1, two nodes of 8 ranks (each node: tp 2 x dp 4).
# A rank holds 0.5e9 x 2 = 1e9 of weights and 0.5e9 / 8 x 12 = 0.75e9 of optimizer state: 1.75e9.
# The checkpoint is 14e9. A node's distinct pieces: both TP halves of the weights (2 x 1e9) and its 8 ranks'
# optimizer shards (8 x 0.75e9): 8e9.
@pytest.mark.parametrize(("replicas", "directories", "rank_written", "node_written", "job_written", "elsewhere"), [
    ("once", "per-node", 14e9 / 16, 7e9, 14e9, 8e9 - 7e9),
    ("once-per-directory", "per-node", 8e9 / 8, 8e9, 16e9, 0.0),
    ("every-rank", "per-node", 1.75e9, 8 * 1.75e9, 28e9, 0.0),
    ("once-per-directory", "per-rank", 1.75e9, 8 * 1.75e9, 28e9, 0.0),
    ("once", "per-rank", 14e9 / 16, 7e9, 14e9, 8 * (1.75e9 - 14e9 / 16)),
    ("once", "job-shared", 14e9 / 16, 7e9, 14e9, 0.0),
])
def test_each_replica_mode_against_hand_figures(replicas, directories, rank_written, node_written, job_written,
                                                elsewhere):
    split = split_checkpoint(ParameterCount.flat(10**9).stages(1), PRESETS["megatron"],
                             Layout(tp=2, dp=8, zero_stage=1), replicas=replicas, directories=directories)
    assert split.unique.total == pytest.approx(14e9)
    assert split.rank_held.total == pytest.approx(1.75e9)
    assert split.busiest.needed.total == pytest.approx(8e9)
    assert split.rank_written.total == pytest.approx(rank_written)
    assert split.node_written.total == pytest.approx(node_written)
    assert split.job_written == pytest.approx(job_written)
    assert split.busiest.remote_read == pytest.approx(elsewhere)


def test_restore_paths_exist_for_the_mode():
    bandwidths = Bandwidths(d2h=25, host_memcpy=80, disk=5, peer=12.5, object=2.5)
    layout = Layout(tp=2, dp=8, zero_stage=1)
    per_directory = _plan(1e9, layout, "megatron", bandwidths=bandwidths)
    assert per_directory.replicas == "once-per-directory"
    local = per_directory.tiers["local"]
    assert local.restore_from == "own directory" and local.restore_s == pytest.approx(8e9 / 5e9)
    assert local.restorable_s == local.durable_s
    once = _plan(1e9, layout, "megatron", replicas="once", bandwidths=bandwidths)
    local, remote = once.tiers["local"], once.tiers["object"]
    # its directory has the 7e9 it wrote; the 1e9 the other node wrote comes from the object tier
    assert local.restore_from == "own directory + object tier"
    assert local.restore_s == pytest.approx(max(7e9 / 5e9, 1e9 / 2.5e9))
    assert once.tiers["peer"].restore_from == "buddy node + object tier"
    assert local.restorable_s == pytest.approx(remote.durable_s), "restorable only once the object tier has it"
    assert remote.durable_s == pytest.approx(once.staging_s + 7e9 / 5e9 + 7e9 / 2.5e9)
    assert any("directory lacks 1 GB of its ranks' state" in warning for warning in once.warnings)
    shared = _plan(1e9, layout, "megatron", directories="job-shared", bandwidths=bandwidths)
    assert shared.replicas == "once" and shared.tiers["local"].restore_from == "shared directory"
    assert shared.tiers["local"].restore_s == pytest.approx(8e9 / 5e9), "a node reads its ranks' distinct pieces"


# --- the 70B case of issue 32 -------------------------------------------------------------------------------

ISSUE_70B = Layout(tp=8, pp=4, dp=16, zero_stage=1)  # 512 GPUs on 64 nodes; a node is one TP group of one stage


def test_70b_tp8_pp4_dp16_zero1_under_both_modes_matches_the_issue():
    mtbf_s = 1 / (LLAMA3_RATE * 512) * 3600  # 98.96 h
    rank_params = 70e9 / 4 / 8  # one TP shard of one stage: 2.1875e9
    once = _plan(70e9, ISSUE_70B, "adam-mixed", replicas="once")  # the issue's 16 bytes
    default = _plan(70e9, ISSUE_70B, "adam-mixed")
    assert default.replicas == "once-per-directory"

    once_node = 70e9 * 16 / 64  # job-wide: the 1.12 TB over 64 nodes
    assert once_node == 17.5e9
    per_directory_node = 8 * rank_params * (2 + 2 + (4 + 8) / 16)  # every rank's whole state: 83.125e9
    expected = [
        (once, once_node, once_node / 80e9, once_node / 80e9 + once_node / 5e9),
        (default, per_directory_node, per_directory_node / 80e9, per_directory_node / 80e9 + per_directory_node / 5e9),
    ]
    for plan, node, staging, durable in expected:
        local = plan.tiers["local"]
        assert plan.split.node_written.total == pytest.approx(node)
        assert plan.staging_s == pytest.approx(staging) and plan.staging_bound == "host-memory"
        assert local.durable_s == pytest.approx(durable)
        assert local.interval.young_s == pytest.approx(math.sqrt(2 * staging * mtbf_s))
        assert local.storage_per_node == pytest.approx(2 * node)
    # the issue's figures: 17.5 GB, 0.219 s, 3.72 s, 6.58 min, 35 GB; 83.1 GB (4.75x), 1.04 s, 17.7 s, 14.3 min, 166 GB
    assert once.split.node_written.total / GB == pytest.approx(17.5, abs=0.05)
    assert once.staging_s == pytest.approx(0.219, abs=0.001)
    assert once.tiers["local"].durable_s == pytest.approx(3.72, abs=0.01)
    assert once.tiers["local"].interval.young_s / 60 == pytest.approx(6.58, abs=0.01)
    assert once.tiers["local"].storage_per_node / GB == pytest.approx(35, abs=0.1)
    assert default.split.node_written.total / GB == pytest.approx(83.1, abs=0.05)
    assert default.split.node_written.total / once.split.node_written.total == pytest.approx(4.75)
    assert default.staging_s == pytest.approx(1.04, abs=0.01)
    assert default.tiers["local"].durable_s == pytest.approx(17.7, abs=0.05)
    assert default.tiers["local"].interval.young_s / 60 == pytest.approx(14.3, abs=0.05)
    assert default.tiers["local"].storage_per_node / GB == pytest.approx(166, abs=0.5)
    # job-wide, the node's directory lacks what other nodes wrote: 83.125e9 - 17.5e9 from the object tier
    assert once.split.busiest.remote_read == pytest.approx(per_directory_node - once_node)
    assert default.split.busiest.remote_read == 0
    # restore from the local tier: the own directory at 5 GB/s, what other nodes wrote from the object tier at 2.5
    assert once.tiers["local"].restore_s == pytest.approx(max(once_node / 5e9, (per_directory_node - once_node) / 2.5e9))
    assert default.tiers["local"].restore_s == pytest.approx(per_directory_node / 5e9)  # 16.6 s


def test_70b_case_at_megatrons_fourteen_bytes():
    rank = 70e9 / 32 * (2 + (4 + 8) / 16)  # bf16 weights whole, optimizer state over 16 replicas: 6.015625e9
    default = _plan(70e9, ISSUE_70B, "megatron")
    once = _plan(70e9, ISSUE_70B, "megatron", replicas="once")
    assert default.split.node_written.total == pytest.approx(8 * rank)  # 48.125e9
    assert once.split.node_written.total == pytest.approx(70e9 * 14 / 64)  # 15.3125e9
    assert default.split.job_written == pytest.approx(64 * 8 * rank)
    assert once.split.job_written == pytest.approx(70e9 * 14)


# --- a run's length -------------------------------------------------------------------------------------

def test_chinchilla_70b_on_512_gpus_takes_33_days_and_8_failures():
    run = RunLength.from_tokens(1.4e12, parameters=70 * 10**9, flops_per_gpu=400e12, gpus=512)
    compute_s = 6 * 70e9 * 1.4e12 / (512 * 400e12)  # 2.871e6 s
    assert run.compute_s == pytest.approx(compute_s)
    assert run.compute_days == pytest.approx(33.2, abs=0.05)
    plan = _plan(70e9, ISSUE_70B, "megatron", run=run)
    failures = compute_s / 3600 * LLAMA3_RATE * 512
    assert failures == pytest.approx(8.06, abs=0.01)
    assert plan.as_json()["run"]["failures_in_compute_time"] == pytest.approx(failures)
    for name, tier in plan.tiers.items():
        wall = compute_s / (1 - tier.lost.total)
        totals = tier.run
        assert totals.saves == pytest.approx(compute_s / tier.interval.seconds), name
        assert totals.bytes_written == pytest.approx(totals.saves * tier.bytes_per_save), name
        assert totals.wall_s == pytest.approx(wall) and totals.lost_hours == pytest.approx((wall - compute_s) / 3600)
        assert totals.expected_failures == pytest.approx(wall / 3600 * LLAMA3_RATE * 512)
        assert 8.0 < totals.expected_failures < 8.5, "about 8 failures, a few more for the time they cost"
    assert plan.tiers["local"].bytes_per_save == pytest.approx(plan.split.job_written)
    assert plan.tiers["object"].bytes_per_save == pytest.approx(70e9 * 14), "chunks stored once"
    assert RunLength.from_days(33).compute_s == 33 * 86400


def test_a_sync_save_waits_for_the_tier_and_checkpoints_less_often():
    # the issue's 7B on 64 GPUs: 16 bytes, plain data parallelism, replicas written once job-wide
    mtbf_s = 1 / (LLAMA3_RATE * 64) * 3600  # 791.9 h
    plan = _plan(7e9, Layout(dp=64), "adam-mixed", replicas="once")
    node = 7e9 * 16 / 8  # 14e9 per node of 8
    staging, local_durable = node / 80e9, node / 80e9 + node / 5e9  # 0.175 s, 2.975 s
    local = plan.tiers["local"]
    assert plan.staging_s == pytest.approx(staging) and local.durable_s == pytest.approx(local_durable)
    assert local.interval.young_s == pytest.approx(math.sqrt(2 * staging * mtbf_s))
    assert local.sync.stall_s == pytest.approx(local_durable)
    assert local.sync.interval.young_s == pytest.approx(math.sqrt(2 * local_durable * mtbf_s))
    assert local.interval.young_s / 60 == pytest.approx(16.6, abs=0.05)  # the issue's figures
    assert local.sync.interval.young_s / 60 == pytest.approx(68.6, abs=0.05)
    assert local.sync.interval.seconds / 60 == pytest.approx(68.6, abs=0.05), "Daly's is within a second of Young's"
    assert local.sync.lost.overhead == pytest.approx(local_durable / (local.sync.interval.seconds + local_durable))
    assert 1 - local.sync.lost.total < 1 - local.lost.total, "sync saves lose more"
    # the manager's default on 8 nodes: each node's directory holds 8 full replicas' distinct pieces: all 112e9
    per_directory = _plan(7e9, Layout(dp=64), "adam-mixed")
    assert per_directory.split.node_written.total == pytest.approx(112e9)
    fsdp = _plan(7e9, Layout(dp=64, zero_stage=3), "fsdp2")
    assert fsdp.split.node_written.total == pytest.approx(7e9 * 12 / 8), "FSDP shards everything: nothing repeats"
    assert fsdp.tiers["local"].sync.interval.young_s == pytest.approx(
        math.sqrt(2 * (10.5e9 / 80e9 + 10.5e9 / 5e9) * mtbf_s))


# --- the object store's job-wide rate -------------------------------------------------------------------

def test_a_job_wide_object_store_rate_beyond_the_limit_warns():
    layout = Layout(tp=8, dp=128)  # 1024 GPUs on 128 nodes: 128 x 2.5 = 320 GB/s into the store
    plan = _plan(175e9, layout, "megatron", mtbf_hours=100)
    assert plan.object_store.assumed_gbps == pytest.approx(320) and plan.object_store.limit_gbps == 100
    assert any("128 node(s) x 2.5 GB/s = 320 GB/s into the object store at once, beyond 100 GB/s" in warning
               for warning in plan.warnings)
    assert not _plan(175e9, layout, "megatron", mtbf_hours=100, object_store_limit_gbps=400).object_store.beyond_limit
    capped = _plan(175e9, layout, "megatron", mtbf_hours=100, bandwidths=Bandwidths(object_job=80))
    assert capped.object_store.assumed_gbps == 80 and not capped.object_store.beyond_limit
    with override(plan_object_store_limit_gb_per_s=500.0):
        assert _plan(175e9, layout, "megatron", mtbf_hours=100).object_store.limit_gbps == 500
    small = _plan(7e9, Layout(dp=64), "fsdp2")
    assert small.object_store.assumed_gbps == 20 and not small.object_store.beyond_limit


@pytest.mark.parametrize(("make", "says"), [
    (lambda: RunLength.from_days(0), "--run-days must be a positive number"),
    (lambda: RunLength.from_tokens(-1, parameters=7, flops_per_gpu=1e12, gpus=8), "--tokens must be a positive"),
    (lambda: RunLength.from_tokens(1e12, parameters=7, flops_per_gpu=float("nan"), gpus=8), "--tflops-per-gpu"),
    (lambda: split_checkpoint([(10, 0)], PRESETS["fsdp2"], Layout(), replicas="twice"), "--replicas 'twice'"),
    (lambda: _plan(1e9, Layout(), "fsdp2", object_store_limit_gbps=0), "--object-store-limit-gb-per-s must be"),
])
def test_bad_run_and_mode_input_is_a_config_error(make, says):
    with pytest.raises(ConfigError) as caught:
        make()
    assert says in str(caught.value) and caught.value.exit_code == 2
