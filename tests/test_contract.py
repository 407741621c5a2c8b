"""The contract between loader and trainer: one plan specification (dataclass <-> proto <-> CLI <-> trainer
config), model conventions over gRPC, Redis discovery without server code, and the import boundaries."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import FEATURES, CostModel, Oversize, PlanConfig, Strategy

plan_configs = st.builds(
    lambda dp, m, p, strategy, caps, targets, iterations, per_pack, oversize, cost: PlanConfig(
        dp=dp, microbatches=m, pipeline_stages=p, strategy=strategy, vision_cap=caps and caps[0],
        token_cap=caps and caps[1], vision_target=targets[0], token_target=targets[1], isf_iterations=iterations,
        samples_per_pack=per_pack, oversize=oversize, cost_model=cost),
    st.integers(1, 4096), st.integers(1, 64), st.integers(1, 64), st.sampled_from(list(Strategy)),
    st.none() | st.tuples(st.integers(1, 10**6), st.integers(1, 10**7)),
    st.tuples(st.none() | st.integers(1, 10**6), st.none() | st.integers(1, 10**7)), st.integers(1, 100),
    st.floats(1, 64, allow_nan=False), st.sampled_from(list(Oversize)),
    st.just(CostModel.from_shapes()) | st.builds(CostModel, *[st.floats(0.001, 1e12)] * 4))


@settings(max_examples=200, deadline=None)
@given(plan_configs)
def test_plan_config_survives_the_wire(config):
    wire = pb.PlanSpec.FromString(config.to_proto().SerializeToString())
    assert PlanConfig.from_proto(wire) == config
    assert PlanConfig.from_dict(config.to_dict()) == config


def test_an_unset_field_means_the_default_but_dp_must_be_stated():
    assert PlanConfig.from_proto(pb.PlanSpec(dp=8)) == PlanConfig()
    with pytest.raises(ValueError, match="is required"):
        PlanConfig.from_proto(pb.PlanSpec(microbatches=2))
    assert not PlanConfig().to_proto().HasField("cost_model")
    assert PlanConfig.from_proto(pb.PlanSpec(dp=1, strategy="isf")).strategy is Strategy.ISF


# OpenJobRequest bytes as a v1 client generated before the counts had presence sends them: job "old-node",
# plan {dp: 2, microbatches: 0, pipeline_stages: 0, isf_iterations: 0} (each 0 written out), epochs 1
OLD_CLIENT_OPEN = bytes.fromhex("0a086f6c642d6e6f6465" "1a0808021000180040" "00" "2801")


def test_an_old_clients_zero_counts_mean_the_defaults():
    """0 meant "the default" for every v1 count before presence came; the server still takes it so."""
    request = pb.OpenJobRequest.FromString(OLD_CLIENT_OPEN)
    assert request.job == "old-node" and request.plan.HasField("pipeline_stages") and request.epochs == 1
    assert PlanConfig.from_proto(request.plan) == PlanConfig(dp=2)
    spec = pb.PlanSpec(dp=2, microbatches=0, pipeline_stages=0, isf_iterations=0, collective_safe=False)
    assert PlanConfig.from_proto(spec) == PlanConfig(dp=2, collective_safe=False)  # false stays a choice


@pytest.mark.parametrize("spec, message", [
    (pb.PlanSpec(dp=2, strategy="magic"), "strategy must be one of"),
    (pb.PlanSpec(dp=2, oversize="squash"), "oversize must be one of"),
    (pb.PlanSpec(dp=2, vision_cap=8), "give both vision_cap and token_cap"),
    (pb.PlanSpec(dp=2, cost_model=pb.CostCoefficients(llm_linear=-1)), "finite, >= 0"),
    (pb.PlanSpec(dp=2, cost_model=pb.CostCoefficients(llm_linear=float("nan"))), "finite, >= 0"),
    (pb.PlanSpec(dp=2, cost_model=pb.CostCoefficients(llm_linear=float("inf"))), "finite, >= 0"),
    (pb.PlanSpec(dp=2**32 - 1), "dp must be <= 65536"),
    (pb.PlanSpec(dp=2, microbatches=10**6), "microbatches must be <= 1024"),
    (pb.PlanSpec(dp=2, pipeline_stages=5000), "pipeline_stages must be <= 1024"),
    (pb.PlanSpec(dp=2, isf_iterations=2**32 - 1), "isf_iterations must be <= 100"),
    (pb.PlanSpec(dp=2, samples_per_pack=float("nan")), "samples_per_pack must be >= 1"),
    (pb.PlanSpec(dp=2, samples_per_pack=1e9), "samples_per_pack must be <= 1024"),
])
def test_bad_plan_specs_fail_where_they_enter(spec, message):
    with pytest.raises(ValueError, match=message):
        PlanConfig.from_proto(spec)


@pytest.mark.parametrize("turned_on, recorded", [
    ({}, set()),
    ({"window": 100}, {"window"}),
    ({"strategy": "isf+phases"}, {"ranks_per_node"}),
    ({"strategy": "isf+phases", "colocate_encoder": True}, {"ranks_per_node", "colocate_encoder"}),
    ({"context_parallel": 2}, {"context_parallel", "max_tokens_per_gpu", "cp_mode"}),
    ({"encoder_ranks": 2}, {"encoder_ranks"}),
    ({"collective_safe": False}, {"collective_safe"}),
    ({"shared_prefix": False}, {"shared_prefix"}),
    ({"live": True, "step_samples": 8}, {"live", "step_samples", "step_tokens", "steps"}),
    ({"live": True, "step_samples": 8, "max_staleness": 2}, {"live", "step_samples", "step_tokens", "steps",
                                                              "max_staleness"}),
])
def test_a_plan_records_a_features_fields_only_while_it_is_on(turned_on, recorded):
    """The feature table (`options.FEATURES`): a plan without a feature records what plans did before it existed
    (so their fingerprints stay); every field belongs to one feature or is always recorded."""
    owned = [name for feature in FEATURES for name in feature.fields]
    assert len(owned) == len(set(owned))
    always = {f.name for f in dataclasses.fields(PlanConfig)} - set(owned)
    assert always == {"dp", "microbatches", "pipeline_stages", "strategy", "vision_cap", "token_cap",
                      "vision_target", "token_target", "isf_iterations", "samples_per_pack", "oversize", "cost_model"}
    assert set(PlanConfig(dp=4, **turned_on).to_dict()) == always | recorded


def test_whether_a_plan_shares_prefixes_is_answered_once_for_an_index_and_a_live_job():
    default = PlanConfig(dp=2)
    assert default.shares_prefixes(grouped=True) and not default.shares_prefixes(grouped=False)
    assert not PlanConfig(dp=2, shared_prefix=False).shares_prefixes(True)
    assert not PlanConfig(dp=2, strategy="random").shares_prefixes(True)  # the padded baselines batch as they come
    assert PlanConfig(dp=2, live=True, step_samples=8).shares_prefixes(True)
    assert default.prefix_sharing_refusal() == ""
    for refused, why in (({"context_parallel": 2}, "context parallelism"), ({"strategy": "isf+phases"}, "isf+phases"),
                         ({"encoder_ranks": 2}, "encoder ranks"),
                         ({"live": True, "step_samples": 8, "context_parallel": 2}, "context parallelism")):
        refusal = PlanConfig(dp=4, **refused).prefix_sharing_refusal()
        assert why in refusal and "shared_prefix false" in refusal
    assert "further encoders" in default.prefix_sharing_refusal(further_encoders=True)


def test_cli_flags_are_the_plan_config_fields():
    from packfeed.cli import build_parser
    from packfeed.cli.options import plan_config_of

    parser = build_parser()
    for command in ("plan", "stats"):
        sub = parser._subparsers._group_actions[0].choices[command]
        flags = {action.dest for action in sub._actions}
        assert {f.name for f in dataclasses.fields(PlanConfig)} <= flags, command
    args = parser.parse_args(["plan", "--index", "i.parquet", "--dp", "2", "--strategy", "isf", "--vision-cap", "8",
                              "--token-cap", "4096", "--samples-per-pack", "3.5"])
    assert plan_config_of(args) == PlanConfig(dp=2, strategy="isf", vision_cap=8, token_cap=4096, samples_per_pack=3.5)
    assert plan_config_of(parser.parse_args(["plan", "--index", "i.parquet"])) == PlanConfig()


def test_trainer_plan_fields_match_the_plan_config():
    from packfeed.trainer.config import PLAN_FIELDS, DataConfig

    data = DataConfig(target="localhost:1")
    defaults = PlanConfig()
    assert set(PLAN_FIELDS) <= {f.name for f in dataclasses.fields(PlanConfig)}
    # a pipeline wants M > 1: the trainer's default is 4; it shards no tower apart: collective safety off
    for name in set(PLAN_FIELDS) - {"microbatches", "collective_safe"}:
        assert getattr(data, name) == getattr(defaults, name), name
    assert defaults.collective_safe and not data.collective_safe
    assert data.plan_config(dp=4, pipeline_stages=2) == PlanConfig(dp=4, pipeline_stages=2, microbatches=data.microbatches,
                                                                   collective_safe=False)
    with pytest.raises(ValueError, match="strategy must be one of"):
        DataConfig(target="localhost:1", strategy="greedy")


def test_client_and_trainer_import_no_server_code():
    """The trainer side runs where no loader code is installed: importing it must not pull packfeed.server."""
    code = ("import sys, packfeed.trainer.train, packfeed.trainer.simulate\n"
            "from packfeed.client import *  # every name the package exports, each loading its module\n"
            "assert 'packfeed.client.stream.pack_stream' in sys.modules\n"
            "print(sorted(m for m in sys.modules if m.startswith('packfeed.server')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_finding_servers_needs_no_torch():
    """`packfeed.client.stream.discovery` (which the servers' coordinator also connects through) loads without torch:
    the client package loads each exported name's module on first use."""
    code = ("import sys, packfeed.client.stream.discovery, packfeed.client\n"
            "print('torch' in sys.modules, packfeed.client.PackStream.__module__, 'torch' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.split() == ["False", "packfeed.client.stream.pack_stream", "True"]


def test_redis_key_layout_is_what_servers_write_and_clients_read(tmp_path):
    """Discovery reads the `servers` key of packfeed.v1.redis_keys directly, from a real redis-server that a
    real RedisCoordinator wrote to."""
    from redis_server import RedisProcess

    from packfeed.client import servers_from_redis
    from packfeed.server.cluster.redis_coordinator import RedisCoordinator

    redis = RedisProcess(tmp_path).start()
    try:
        coordinator = RedisCoordinator(redis.url, prefix="custom:")
        coordinator.heartbeat_server("10.0.0.2:50051", 30)
        coordinator.heartbeat_server("10.0.0.1:50051", 30)
        coordinator.acquire_lease("job", 3, "10.0.0.1:50051", 30)
        assert servers_from_redis(redis.url, prefix="custom:") == ["10.0.0.1:50051", "10.0.0.2:50051"]
        assert servers_from_redis(redis.url) == []  # another prefix, another deployment
        assert coordinator.client.get("custom:lease:job:3") == "10.0.0.1:50051"
    finally:
        redis.stop()


def test_sentinel_urls_parse_and_bad_ones_say_the_form():
    from packfeed.v1.redis_url import parse_sentinel_url

    assert parse_sentinel_url("redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/main/3") == (
        [("10.0.0.1", 26379), ("10.0.0.2", 26380)], "main", 3)
    assert parse_sentinel_url("redis+sentinel://s:26379/main") == ([("s", 26379)], "main", 0)
    for bad in ("redis+sentinel://s:26379", "redis+sentinel://s:port/main", "redis+sentinel://:26379/main",
                "redis+sentinel://s:26379/main/0/extra"):
        with pytest.raises(ValueError, match="SERVICE"):
            parse_sentinel_url(bad)
