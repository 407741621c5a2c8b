"""The loader service end to end: real `packfeed serve` processes, real gRPC on loopback, real shards."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ports import free_port
from packfeed.client import LocalServer, PackfeedError, PackStream
from packfeed.server.index.table import read_index
from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PLAN = {"dp": 2, "microbatches": 2, "pipeline_stages": 2}


@pytest.fixture(scope="module")
def server(dataset):
    port = free_port()
    with LocalServer(dataset, workers=2, metrics_port=port) as running:
        running.metrics_port = port
        yield running




def valid_keys(index) -> list[str]:
    table, _ = read_index(index, columns=["key", "valid"])
    return [k for k, v in zip(table.column("key").to_pylist(), table.column("valid").to_pylist()) if v]


def consume(target, job, rank, **kwargs):
    """Every step of the rank: (keys, skipped, per-step digest of all tensor bytes)."""
    keys, skipped, digests = [], [], []
    with PackStream(target, job=job, rank=rank, **{**PLAN, **kwargs}) as stream:
        for step in stream:
            assert len(step.packs) == PLAN["microbatches"]
            for pack in step.packs:
                keys += pack.sample_keys
                skipped += pack.skipped
            digests.append(step_digest(step))
    return keys, skipped, digests


def test_every_valid_sample_exactly_once_and_counts_are_consistent(server, dataset):
    delivered = []
    with PackStream(server.target, job="once", rank=0, **PLAN) as stream:
        steps = list(stream)
        assert [s.step for s in steps] == list(range(stream.info.steps_per_epoch))
    for step in steps:
        for pack in step.packs:
            delivered += pack.sample_keys
            n = len(pack.sample_keys)
            assert pack.cu_seqlens.tolist()[-1] == len(pack.input_ids) == len(pack.labels)
            assert len(pack.cu_seqlens) == n + 1
            assert pack.loss_tokens == int((pack.labels != -100).sum())
            assert pack.empty == (n == 0)
            assert sum(c * h * w for c, h, w in pack.tile_shapes.tolist()) == len(pack.pixels)
            for start, length in pack.image_token_spans.tolist():
                assert (pack.input_ids[start:start + length] == pack.input_ids[start]).all()
    delivered += consume(server.target, "once", 1)[0]
    assert sorted(delivered) == sorted(valid_keys(dataset))
    # every rank normalises by the same planned global-step loss-token count
    assert all(len({p.step_loss_tokens for p in s.packs}) == 1 for s in steps)


def test_epochs_follow_each_other_with_new_orders(server, dataset):
    by_epoch = {0: [], 1: []}
    orders = []
    for rank in range(2):
        with PackStream(server.target, job="two-epochs", rank=rank, epochs=2, seed=3, **PLAN) as stream:
            steps = list(stream)
        orders.append([(s.epoch, s.step) for s in steps])
        for step in steps:
            by_epoch[step.epoch] += step.sample_keys
    assert all(sorted(keys) == sorted(valid_keys(dataset)) for keys in by_epoch.values())
    assert orders[0][0] == (0, 0) and orders[0][-1][0] == 1 and orders[0] == sorted(orders[0])
    assert by_epoch[0] != by_epoch[1]


def test_identical_bytes_across_runs_workers_and_prefetch(server, dataset):
    first = [consume(server.target, "bytes-a", rank)[2] for rank in range(2)]
    again = [consume(server.target, "bytes-b", rank)[2] for rank in range(2)]
    with LocalServer(dataset, workers=1, prefetch_steps=1) as other:
        restarted = [consume(other.target, "bytes-a", rank)[2] for rank in range(2)]
    assert first == again == restarted
    assert len({d for rank in first for _, _, d in rank}) == sum(len(rank) for rank in first)


def test_resume_from_state_dict_continues_identically(server):
    whole = consume(server.target, "resume-ref", 0)[2]
    stream = PackStream(server.target, job="resume", rank=0, **PLAN)
    next(stream)
    state = stream.state_dict()
    stream.close()
    resumed = PackStream(server.target, job="resume", rank=0, **PLAN)
    resumed.load_state_dict(state)
    rest = [step_digest(step) for step in resumed]
    resumed.close()
    assert rest == whole[1:]
    info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job="resume"))
    assert (info.ranks[0].acked_epoch, info.ranks[0].acked_step) == (0, len(whole) - 1)


def test_stream_survives_a_server_restart(server, dataset):
    whole = consume(server.target, "restart-ref", 0)[2]
    port = free_port()
    listen = ["--listen", f"127.0.0.1:{port}"]
    first = LocalServer(dataset, workers=1, prefetch_steps=1, extra_args=listen).start()
    stream = PackStream(first.target, job="restart", rank=0, prefetch=1, backoff=0.5, retries=6, **PLAN)
    try:
        got = [step_digest(next(stream))]
        first.stop()  # the job and every prepared pack are gone with it
        with LocalServer(dataset, workers=1, extra_args=listen):
            got += [step_digest(step) for step in stream]
    finally:
        stream.close()
        first.stop()
    assert got == whole


def step_digest(step):
    digest = hashlib.sha256()
    for pack in step.packs:
        for name in sorted(pack.tensors):
            digest.update(name.encode() + pack.tensors[name].numpy().tobytes())
    return step.epoch, step.step, digest.hexdigest()


def test_corrupt_image_and_vanished_shard_are_skipped_and_reported(tmp_path, dataset):
    root = tmp_path / "broken"
    root.mkdir()
    table, _ = read_index(dataset, columns=["key", "shard", "valid", "image_offsets"])
    rows = [r for r in table.to_pylist() if r["valid"]]
    shards = sorted({r["shard"] for r in rows})
    for shard in shards:
        shutil.copy(shard, root / os.path.basename(shard))
    victim = next(r for r in rows if r["image_offsets"] and r["shard"] == shards[0])
    with open(root / os.path.basename(victim["shard"]), "r+b") as f:  # same size, unreadable image header
        f.seek(victim["image_offsets"][0])
        f.write(b"\0" * 64)
    os.remove(root / os.path.basename(shards[-1]))
    gone = {r["key"] for r in rows if r["shard"] == shards[-1]}

    with LocalServer(dataset, workers=1, extra_args=["--shard-root", str(root)],
                     env={"PACKFEED_MAX_SKIPPED_FRACTION": "1"}) as server:  # a whole shard gone: tolerate it here
        keys, skipped = [], []
        for rank in range(2):
            k, s, digests = consume(server.target, "broken", rank)
            keys += k
            skipped += s
            assert len(digests) > 0
        info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job="broken"))
    reasons = dict(skipped)
    assert "shard changed" in reasons[victim["key"]]  # the checksum catches it before decoding
    assert all("shard unreadable" in reasons[key] for key in gone)
    assert sorted(keys + list(reasons)) == sorted(r["key"] for r in rows)
    assert info.skipped_count == len(skipped) == len(gone) + 1
    assert any('"event": "sample skipped"' in line for line in server.log)


def test_bad_requests_get_status_codes(server):
    stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
    stub.OpenJob(pb.OpenJobRequest(job="codes", plan=pb.PlanSpec(**PLAN)))

    def code_of(call):
        with pytest.raises(grpc.RpcError) as raised:
            result = call()
            if hasattr(result, "__next__"):
                next(result)
        return raised.value.code()

    assert code_of(lambda: stub.GetJob(pb.GetJobRequest(job="nope"))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.StreamPacks(pb.StreamPacksRequest(job="nope"))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.StreamPacks(pb.StreamPacksRequest(job="codes", rank=2))) == grpc.StatusCode.OUT_OF_RANGE
    assert code_of(lambda: stub.StreamPacks(pb.StreamPacksRequest(job="codes", first_step=10**6))) \
        == grpc.StatusCode.OUT_OF_RANGE
    assert code_of(lambda: stub.StreamPacks(pb.StreamPacksRequest(job="codes", first_epoch=1))) \
        == grpc.StatusCode.OUT_OF_RANGE
    assert code_of(lambda: stub.OpenJob(pb.OpenJobRequest(job="codes", plan=pb.PlanSpec(dp=3)))) \
        == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: stub.OpenJob(pb.OpenJobRequest(job="x", plan=pb.PlanSpec(strategy="magic")))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.OpenJob(pb.OpenJobRequest(job="", plan=pb.PlanSpec()))) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.OpenJob(pb.OpenJobRequest(job="y", dataset="other", plan=pb.PlanSpec(dp=2)))) \
        == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.AckStep(pb.AckStepRequest(job="codes", rank=0, step=10**6))) \
        == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(PackfeedError, match="FAILED_PRECONDITION"):
        PackStream(server.target, job="codes", rank=0, dp=4)
    # the server keeps serving after all of that
    assert len(consume(server.target, "codes", 0)[2]) > 0


def test_pack_parts_carry_the_same_packs_in_bounded_messages(dataset):
    with LocalServer(dataset, workers=1, env={"PACKFEED_PACK_PART_KB": "64"}) as running:
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(running.target, options=[
            ("grpc.max_receive_message_length", 256 << 20)]))
        stub.OpenJob(pb.OpenJobRequest(job="parts", plan=pb.PlanSpec(**PLAN)))
        request = pb.StreamPacksRequest(job="parts", rank=0)
        whole = [pack.SerializeToString() for pack in stub.StreamPacks(request)]
        parts = list(stub.StreamPackParts(request))
    assert max(len(part.data) for part in parts) == 64 << 10  # the packs here are larger than one part
    joined, pieces = [], []
    for part in parts:
        pieces.append(part.data)
        if part.last:
            joined.append(b"".join(pieces))
            pieces = []
    assert not pieces and [pb.Pack.FromString(j) for j in joined] == [pb.Pack.FromString(w) for w in whole]


def test_a_measured_cost_model_travels_with_the_job(server):
    """A trainer's measured coefficients (PlanSpec.cost_model) change what the planner balances on; they are
    part of the job's identity, and nonsense coefficients are refused."""
    stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
    measured = {"vision_linear": 2e-6, "vision_quadratic": 0.0, "llm_linear": 3e-5, "llm_quadratic": 1e-9}
    default = stub.OpenJob(pb.OpenJobRequest(job="costs-default", plan=pb.PlanSpec(**PLAN)))
    custom = stub.OpenJob(pb.OpenJobRequest(job="costs-measured", plan=pb.PlanSpec(
        **PLAN, cost_model=pb.CostCoefficients(**measured))))
    assert custom.plan.cost_model.llm_linear == measured["llm_linear"]
    assert not default.plan.HasField("cost_model")
    assert custom.plan_fingerprint != default.plan_fingerprint
    stream = PackStream(server.target, job="costs-measured", rank=0, dp=PLAN["dp"],
                        microbatches=PLAN["microbatches"], pipeline_stages=PLAN["pipeline_stages"],
                        cost_model=measured)  # joins: same settings
    assert stream.info.plan_fingerprint == custom.plan_fingerprint
    stream.close()
    with pytest.raises(grpc.RpcError) as raised:
        stub.OpenJob(pb.OpenJobRequest(job="costs-measured", plan=pb.PlanSpec(**PLAN)))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as raised:
        stub.OpenJob(pb.OpenJobRequest(job="costs-bad", plan=pb.PlanSpec(
            **PLAN, cost_model=pb.CostCoefficients(llm_linear=-1.0))))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_job_info_carries_the_model_conventions(server, dataset):
    """A remote trainer learns what its model must know of the dataset over gRPC, never from the index file."""
    from packfeed.media.chat import ChatTemplate, load_tokenizer
    from packfeed.server.index.table import read_index_info

    info = read_index_info(dataset)
    tokenizer = load_tokenizer(info.tokenizer["path"], ChatTemplate.from_dict(info.chat_template))
    with PackStream(server.target, job="conventions", rank=0, **PLAN) as stream:
        conventions = stream.conventions
        keys = {key for step in stream for key in step.sample_keys}
    assert keys
    policy = conventions.image_policy
    assert (policy.name, policy.tile_size, policy.tokens_per_tile, policy.patch_size, policy.patches_per_unit) == \
        ("internvl", 448, 256, 14, 1024)
    assert json.loads(policy.parameters_json) == {**info.image_policy, **json.loads(policy.parameters_json)}
    assert conventions.vocab_size == tokenizer.get_vocab_size()
    assert conventions.image_context_id == tokenizer.token_to_id("<IMG_CONTEXT>")
    assert (conventions.image_start_id, conventions.image_end_id) == \
        (tokenizer.token_to_id("<img>"), tokenizer.token_to_id("</img>"))
    assert conventions.chat_template.user_prefix == "<|im_start|>user\n"
    assert conventions.chat_template.turn_start == "<|im_start|>"  # deprecated, kept for older clients


def test_grouped_and_flat_stream_options_open_the_same_job(server):
    """PackStream(plan=PlanConfig(...), connection=Connection(...)) and the flat keywords of earlier versions
    mean the same job; mixing a group with its flat fields, or an unknown keyword, is refused."""
    from packfeed.client import Connection, PlanConfig

    grouped = PackStream(server.target, job="grouped", rank=0, plan=PlanConfig(**PLAN, strategy="isf"),
                         connection=Connection(timeout=30, retries=2))
    flat = PackStream(server.target, job="grouped", rank=1, **PLAN, strategy="isf", timeout=30, retries=2)
    assert flat.info.plan_fingerprint == grouped.info.plan_fingerprint
    assert (flat.plan, flat.connection) == (grouped.plan, grouped.connection)
    grouped.close()
    flat.close()
    with pytest.raises(TypeError, match="not both"):
        PackStream(server.target, job="grouped", rank=0, plan=PlanConfig(**PLAN), dp=2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        PackStream(server.target, job="grouped", rank=0, **PLAN, prefech=3)
    # the seat: one argument (a Seat, or an LLM rank's number), the earlier keywords mapped onto it
    from packfeed.client import Seat

    for earlier in (dict(seat=1), dict(rank=1), dict(seat=Seat(1))):
        stream = PackStream(server.target, job="grouped", **earlier, plan=PlanConfig(**PLAN, strategy="isf"))
        assert stream.seat == Seat(1) and stream.info.plan_fingerprint == grouped.info.plan_fingerprint
        stream.close()
    with pytest.raises(ValueError, match="exactly one of them"):
        PackStream(server.target, job="grouped", seat=0, rank=0, **PLAN)


def test_health_reflection_and_metrics(server):
    channel = grpc.insecure_channel(server.target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "packfeed.v1.Packfeed"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(reflect.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="packfeed.v1.Packfeed")])))
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"packfeed.v1.Packfeed", "grpc.health.v1.Health"} <= names
    assert answers[1].file_descriptor_response.file_descriptor_proto

    consume(server.target, "metrics", 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    sent = [line for line in text.splitlines() if line.startswith('packfeed_packs_total{job="metrics"}')]
    assert sent and float(sent[0].split()[-1]) > 0
    assert "packfeed_preprocess_seconds_per_sample_count" in text
    assert 'packfeed_rank_lag_steps{job="metrics",rank="0"} 0.0' in text


def test_token_auth(dataset, monkeypatch):
    with LocalServer(dataset, workers=1, env={"PACKFEED_AUTH_TOKEN": "s3cret"}) as server:
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED"):
            PackStream(server.target, job="auth", rank=0, **PLAN)
        monkeypatch.setenv("PACKFEED_AUTH_TOKEN", "s3cret")  # the client reads the variable the server reads
        with PackStream(server.target, job="auth-env", rank=0, **PLAN) as stream:
            assert next(iter(stream)).sample_keys
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED"):  # an explicit empty token: none
            PackStream(server.target, job="auth", rank=0, token="", **PLAN)
        monkeypatch.delenv("PACKFEED_AUTH_TOKEN")
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED"):
            PackStream(server.target, job="auth", rank=0, token="wrong", **PLAN)
        keys = []
        with PackStream(server.target, job="auth", rank=0, token="s3cret", **PLAN) as stream:
            for step in stream:
                keys += step.sample_keys
        assert keys
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        for header in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):  # the scheme is case-insensitive
            assert stub.GetJob(pb.GetJobRequest(job="auth"), metadata=(("authorization", header),)).job == "auth"
        for header in ("Basic s3cret", "s3cret", "Bearer S3CRET", "Bearer"):
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetJob(pb.GetJobRequest(job="auth"), metadata=(("authorization", header),))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_embedded_server_from_an_index(dataset):
    with PackStream(job="embedded", rank=1, index=str(dataset), **PLAN) as stream:
        steps = list(stream)
    assert steps and all(len(s.packs) == PLAN["microbatches"] for s in steps)


def test_plans_of_ranks_epochs_apart_are_served_from_a_bounded_cache(dataset):
    """Ranks drift apart: asking for an old epoch after newer ones must not evict the plan being returned
    (a bug 64 concurrent streams found), and a recomputed plan is the same plan."""
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobSpec
    from packfeed.server.serve.jobs import PLANS_CACHED
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.server.serve.step_work import DatasetSource
    from packfeed.v1.options import PlanConfig

    source = DatasetSource(str(dataset), str(read_index_info_tokenizer(dataset)))
    registry = JobRegistry({"d": Dataset.open("d", source)})
    job = registry.open_job(JobSpec("drift", "d", PlanConfig(dp=2, microbatches=1), 0, epochs=5))
    first = job.epoch_plan(0).fingerprint()
    for epoch in [1, 2, 3, 4, 0, 4, 1]:
        assert job.epoch_plan(epoch).epoch == epoch
        assert len(job._plans) <= PLANS_CACHED
    assert job.epoch_plan(0).fingerprint() == first


def read_index_info_tokenizer(index):
    from packfeed.server.index.table import read_index_info

    return read_index_info(index).tokenizer["path"]


def test_many_streams_under_a_budget_smaller_than_one_step_all_finish(dataset):
    """Every step must wait its turn for room, and no stream may sit on room it reserved for prefetching
    while its prepared step waits: with a 1 MB budget (less than one step) four ranks finish three epochs."""
    import threading

    with LocalServer(dataset, workers=1, env={"PACKFEED_MEMORY_BUDGET_MB": "1"}) as tight:
        results: dict[int, list] = {}

        def run(rank):
            results[rank] = consume(tight.target, "tight", rank, dp=4, epochs=3)[0]

        threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert not any(t.is_alive() for t in threads), "streams stalled under a tight memory budget"
    assert sorted(k for keys in results.values() for k in keys) == sorted(valid_keys(dataset) * 3)


def test_a_job_id_reused_without_its_saved_state_is_warned_about(server):
    """A rank that acknowledged steps, streamed again from the first step without `load_state_dict`: a warning
    that says how to continue; with the saved state, or on another job id, none."""
    import warnings

    with PackStream(server.target, job="reused", rank=0, **PLAN) as stream:
        iterator = iter(stream)
        next(iterator)
        next(iterator)
        state = stream.state_dict()
    with PackStream(server.target, job="reused", rank=0, **PLAN) as again:
        with pytest.warns(RuntimeWarning, match="already acknowledged epoch 0 step 1.*load_state_dict"):
            next(iter(again))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PackStream(server.target, job="reused", rank=0, **PLAN) as resumed:
            resumed.load_state_dict(state)
            assert next(iter(resumed)).step == 2
        with PackStream(server.target, job="reused-fresh", rank=0, **PLAN) as fresh:
            assert next(iter(fresh)).step == 0
