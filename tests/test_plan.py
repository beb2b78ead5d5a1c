"""``ckptd plan``'s arithmetic against figures computed by hand (each expected value is written out)."""

from __future__ import annotations

import math

import pytest

from ckptd.errors import ConfigError
from ckptd.planning import (PRESETS, Bandwidths, Layout, ParameterCount, PlanInputs, Retention, StateBytes,
                            daly_interval_s, job_mtbf_hours, lost_fraction, make_plan, per_gpu_failures_per_hour,
                            shape_from_config, split_checkpoint, young_interval_s)

P70 = ParameterCount.flat(70_000_000_000)
#: The 16 bytes of bf16 weights and gradients, fp32 master weights and two moments (the old default).
ADAM_MIXED = PRESETS["adam-mixed"]

LLAMA2_7B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
             "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 32,
             "tie_word_embeddings": False}
LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
             "num_attention_heads": 32, "num_key_value_heads": 8}
MIXTRAL_8X7B = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8}
MISTRAL_7B = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
              "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8}
QWEN25_7B = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
             "vocab_size": 152064, "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False}
GPT2 = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


def _split(layout: Layout, *, count: ParameterCount = P70, dedup: bool = True, state: StateBytes = ADAM_MIXED):
    return split_checkpoint(count.stages(layout.pp), state, layout, replicas="once" if dedup else "every-rank")


# --- bytes over layouts ------------------------------------------------------------------------------

def test_70b_at_16_bytes_is_1_12_tb():
    split = _split(Layout())
    assert ADAM_MIXED.total == 16 and StateBytes().total == 12, "the default is fsdp2's 12 bytes"
    assert split.unique.as_dict() == {"weights": 140 * 10**9, "grads": 140 * 10**9, "master": 280 * 10**9,
                                      "moments": 560 * 10**9, "total": 1_120 * 10**9}
    assert split.rank_written.as_dict()["total"] == 1_120_000_000_000
    assert StateBytes(weights=2, master=4).total == 14  # Megatron's distributed optimizer


def test_zero_1_over_dp_8_divides_the_optimizer_state_by_8():
    plain = _split(Layout(dp=8), dedup=False)
    zero1 = _split(Layout(dp=8, zero_stage=1), dedup=False)
    assert plain.rank_held.as_dict() == {"weights": 140e9, "grads": 140e9, "master": 280e9, "moments": 560e9,
                                         "total": 1_120e9}
    # master 280e9 / 8 = 35e9, moments 560e9 / 8 = 70e9; weights and grads stay whole on every replica
    assert zero1.rank_held.as_dict() == {"weights": 140e9, "grads": 140e9, "master": 35e9, "moments": 70e9,
                                         "total": 385e9}
    assert zero1.rank_written.total == 385e9 and zero1.node_written.total == 8 * 385e9
    deduplicated = _split(Layout(dp=8, zero_stage=1))
    assert deduplicated.rank_written.total == 1_120e9 / 8, "replicas written once: each rank writes an eighth"
    assert deduplicated.node_written.total == 1_120e9 and deduplicated.held_all_ranks.total == 8 * 385e9


def test_zero_2_and_3_shard_grads_then_weights():
    zero2 = _split(Layout(dp=8, zero_stage=2), dedup=False)
    assert zero2.rank_held.as_dict()["total"] == 70e9 * (2 + (2 + 4 + 8) / 8)  # 262.5e9
    zero3 = _split(Layout(tp=2, dp=8, zero_stage=3), dedup=False)
    assert zero3.rank_held.as_dict()["total"] == 70e9 / 2 / 8 * 16  # 70e9: nothing is replicated
    assert _split(Layout(tp=2, dp=8, zero_stage=3)).rank_written.total == zero3.rank_written.total


def test_tp_8_pp_4_per_rank_and_per_node_bytes():
    split = _split(Layout(tp=8, pp=4, dp=1, gpus_per_node=8), dedup=False)
    assert split.rank_held.as_dict() == {"weights": 4_375_000_000, "grads": 4_375_000_000, "master": 8_750_000_000,
                                         "moments": 17_500_000_000, "total": 35_000_000_000}  # 70e9 / 32 x 16
    assert split.node_written.total == 8 * 35e9
    replicated = _split(Layout(tp=8, pp=4, dp=2, gpus_per_node=8))
    assert replicated.rank_written.total == 17.5e9, "dp=2 replicas each write half"
    assert replicated.rank_held.total == 35e9


def test_experts_split_over_ep_and_zero_over_the_expert_replicas():
    count = ParameterCount.flat(10_000_000_000, expert=8_000_000_000)
    split = _split(Layout(dp=8, ep=4, zero_stage=1), count=count, dedup=False)
    held = split.rank_held.as_dict()
    assert held["weights"] == 2 * (2e9 + 8e9 / 4)  # dense whole, a quarter of the experts
    assert held["master"] == 4 * (2e9 / 8 + 8e9 / 4 / 2)  # dense over dp=8, experts over dp/ep = 2
    assert _split(Layout(dp=8, ep=4, zero_stage=1), count=count).rank_written.total == 10e9 * 16 / 8


# --- parameter counts from configs --------------------------------------------------------------------

@pytest.mark.parametrize(("config", "known"), [
    (LLAMA2_7B, 6_738_415_616),     # Llama-2-7B's published count
    (LLAMA3_8B, 8_030_261_248),     # Llama-3-8B (grouped-query attention, 8 key-value heads)
    (MIXTRAL_8X7B, 46_702_792_704),  # Mixtral-8x7B (8 experts per layer and a router)
    (MISTRAL_7B, 7_241_732_096),    # Mistral-7B-v0.1
    (QWEN25_7B, 7_615_616_512),     # Qwen2.5-7B (biases on q, k and v)
    (GPT2, 124_439_808),            # GPT-2 small (tied head, biases, position embeddings)
])
def test_parameter_counts_from_configs_match_the_published_ones(config, known):
    assert shape_from_config(config).parameters().total == known


def test_tensor_parallel_may_replicate_key_value_heads():
    shape_from_config(LLAMA3_8B).check_tensor_parallel(16)  # 8 key-value heads, each on two ranks
    shape_from_config(LLAMA3_8B).check_tensor_parallel(4)


def test_tied_embeddings_drop_the_head_and_experts_are_counted():
    untied = shape_from_config(LLAMA2_7B).parameters().total
    assert shape_from_config(LLAMA2_7B, tied_embeddings=True).parameters().total == untied - 32000 * 4096
    assert shape_from_config(MIXTRAL_8X7B).parameters().expert == 32 * 8 * 3 * 4096 * 14336


def test_pipeline_stages_hold_the_embeddings_first_and_the_head_last():
    stages = shape_from_config(LLAMA2_7B).parameters().stages(4)
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # 202,383,360
    assert [dense for dense, _ in stages] == [8 * per_layer + 32000 * 4096, 8 * per_layer, 8 * per_layer,
                                              8 * per_layer + 4096 + 32000 * 4096]
    assert sum(dense for dense, _ in stages) == 6_738_415_616
    split = _split(Layout(pp=4, gpus_per_node=2), count=shape_from_config(LLAMA2_7B).parameters(), dedup=False)
    assert split.busiest_rank == 3 and split.busiest_node == 1
    assert split.rank_written.total == 16 * (8 * per_layer + 4096 + 32000 * 4096)
    assert split.node_written.total == 16 * (16 * per_layer + 4096 + 32000 * 4096)
    assert [dense for dense, _ in shape_from_config(LLAMA2_7B).parameters().stages(3)][:2] == [
        11 * per_layer + 32000 * 4096, 11 * per_layer], "32 layers over 3 stages: 11, 11, 10"


# --- failures and intervals ----------------------------------------------------------------------------

def test_mtbf_from_419_failures_in_54_days_on_16384_gpus():
    rate = per_gpu_failures_per_hour(419, 54, 16384)
    assert rate == pytest.approx(419 / (54 * 24 * 16384))  # 1.9733e-5 per GPU-hour
    assert rate == pytest.approx(1.97330e-5, rel=1e-5)
    assert job_mtbf_hours(419, 54, 16384, 16384) == pytest.approx(54 * 24 / 419)  # 3.093 h for the whole fleet
    assert job_mtbf_hours(419, 54, 16384, 1024) == pytest.approx(54 * 24 / 419 * 16)  # 49.49 h for 1024 GPUs


def test_young_and_daly_intervals():
    assert young_interval_s(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400))  # 3219.94 s
    ratio = 60 / (2 * 86400)
    assert daly_interval_s(60, 86400) == pytest.approx(math.sqrt(2 * 60 * 86400) * (1 + math.sqrt(ratio) / 3
                                                                                     + ratio / 9) - 60)
    assert daly_interval_s(60, 86400) == pytest.approx(3180.06, abs=0.01)
    assert daly_interval_s(8000, 3600) == 3600, "a cost of 2 MTBF or more: checkpoint every MTBF"


def test_lost_fraction_adds_overhead_recompute_and_restart():
    lost = lost_fraction(interval_s=3000, stall_s=10, durable_lag_s=50, restart_s=600, mtbf_s=86400)
    assert lost.overhead == pytest.approx(10 / 3010)
    assert lost.recompute == pytest.approx((3010 / 2 + 50) / 86400)
    assert lost.restart == pytest.approx(600 / 86400)
    assert lost.total == pytest.approx(10 / 3010 + (1505 + 50 + 600) / 86400)


# --- the whole plan -----------------------------------------------------------------------------------

def _plan(mtbf_hours: float = 24.0, **layout: int):
    return make_plan(PlanInputs(parameters=P70, parameters_from="--params", state=ADAM_MIXED,
                                layout=Layout(**{"dp": 8, "zero_stage": 1, **layout}), mtbf_hours=mtbf_hours,
                                restart_s=600.0, retention=Retention(keep_local=2, keep_peer=1, keep_remote=5),
                                bandwidths=Bandwidths(d2h=10, host_memcpy=100, disk=5, peer=10, object=2)))


def test_a_whole_plan_against_hand_figures():
    plan = _plan()
    assert plan.staging_s == pytest.approx(140e9 / 10e9) and plan.staging_bound == "device-to-host"  # 14 s
    local, peer, remote = (plan.tiers[name] for name in ("local", "peer", "object"))
    assert local.write_s == pytest.approx(1.12e12 / 5e9)  # 224 s
    assert local.durable_s == pytest.approx(14 + 224)
    assert peer.durable_s == pytest.approx(14 + 224 + 1.12e12 / 5e9), "the buddy's disk (5) is slower than the link"
    assert remote.durable_s == pytest.approx(14 + 224 + 560)
    # one node holds the whole job's directory: it reads the 1.12e12 it wrote, nothing from elsewhere
    assert local.restore_s == pytest.approx(1.12e12 / 5e9) and local.restore_from == "own directory"
    assert plan.replicas == "once", "one node, one directory: the manager writes replicas once"
    assert local.storage_per_node == 2 * 1.12e12 and local.peak_per_node == 3 * 1.12e12
    assert remote.storage_total == 5 * 1.12e12 and remote.storage_per_node is None
    assert local.interval.seconds == pytest.approx(daly_interval_s(14, 86400)) and local.interval.bound == "daly"
    assert local.lost.total == pytest.approx(lost_fraction(
        interval_s=daly_interval_s(14, 86400), stall_s=14, durable_lag_s=224, restart_s=600 + local.restore_s,
        mtbf_s=86400).total)


def test_a_tier_that_cannot_keep_up_bounds_the_interval():
    remote = _plan(mtbf_hours=1.0).tiers["object"]
    assert daly_interval_s(14, 3600) < 560 - 14
    assert remote.interval.seconds == pytest.approx(560 - 14) and remote.interval.bound == "tier"


# --- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("make", "says"), [
    (lambda: Layout(tp=-1), "--tp must be a positive integer"),
    (lambda: Layout(zero_stage=4), "unknown ZeRO stage 4"),
    (lambda: Layout(dp=6, ep=4), "--ep 4 does not divide --dp 6"),
    (lambda: Layout(dp=12, gpus_per_node=8), "not a multiple of --gpus-per-node 8"),
    (lambda: Layout.for_world(100, tp=8), "tp x pp = 8 does not divide the world size 100"),
    (lambda: Layout.for_world(64, tp=8, dp=3), "tp x pp x dp = 24 but the world size is 64"),
    (lambda: StateBytes(moments=-1), "--moment-bytes must be a finite number >= 0"),
    (lambda: ParameterCount.flat(0), "the parameter count must be a positive number"),
    (lambda: shape_from_config({"hidden_size": 4096}, source="cfg.json"), "cfg.json: missing num_attention_heads"),
    (lambda: shape_from_config({**LLAMA2_7B, "num_key_value_heads": 5}), "not a multiple of num_key_value_heads"),
    (lambda: shape_from_config(LLAMA2_7B).parameters().stages(33), "--pp 33 exceeds the model's 32 layers"),
    (lambda: per_gpu_failures_per_hour(-1, 54, 16384), "--failures must be a positive number"),
    (lambda: shape_from_config(LLAMA3_8B).check_tensor_parallel(3), "--tp 3 does not divide the model's 32"),
    (lambda: shape_from_config({**LLAMA3_8B, "num_attention_heads": 24, "head_dim": 128}).check_tensor_parallel(6),
     "--tp 6 and the model's 8 key-value heads"),
    (lambda: shape_from_config({**MIXTRAL_8X7B, "n_shared_experts": 2}), "give --params and --expert-params"),
    (lambda: Bandwidths(disk=0), "--disk-gb-per-s must be a positive number"),
    (lambda: Retention(keep_local=-1), "--keep-local must be an integer >= 0"),
])
def test_bad_input_is_a_config_error_naming_the_option(make, says):
    with pytest.raises(ConfigError) as caught:
        make()
    assert says in str(caught.value) and caught.value.exit_code == 2
