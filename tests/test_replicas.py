"""Replicated ranks (tensor / context / sequence parallel groups): the replicas of one DP rank receive identical
packs over real gRPC, each holding a lease of its own (no replica displaces another), and only replica 0's
acknowledgements and deliveries count for the rank."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from packfeed.client import LocalServer, PackStream
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc


def receive(target: str, job: str, rank: int, replica: int, replicas: int = 2) -> list[tuple[int, list]]:
    """Every step of the epoch: (step, [(sample keys, every tensor of the pack), ...])."""
    with PackStream(target, job=job, rank=rank, dp=2, microbatches=2, replica=replica, replicas=replicas) as stream:
        return [(step.step, [(pack.sample_keys, {name: t.clone() for name, t in pack.tensors.items()})
                             for pack in step.packs]) for step in stream]


def job_info(target: str, job: str) -> pb.JobInfo:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.PackfeedStub(channel).GetJob(pb.GetJobRequest(job=job))


def test_replicas_of_a_rank_receive_identical_packs_and_count_once(small_tile_index):
    with LocalServer(small_tile_index, workers=2) as server:
        # replica 1 alone first: it gets the whole epoch, and the rank's cursor does not move
        alone = receive(server.target, "tp", rank=0, replica=1)
        untouched = job_info(server.target, "tp")
        assert (untouched.ranks[0].acked_epoch, untouched.ranks[0].acked_step) == (-1, -1) and len(alone) > 1
        assert not untouched.samples_by_dataset
        # all four consumers at once: 2 DP ranks x 2 replicas, no lease fight
        consumers = [(rank, replica) for rank in range(2) for replica in range(2)]
        with ThreadPoolExecutor(len(consumers)) as pool:
            received = dict(zip(consumers, pool.map(lambda c: receive(server.target, "tp", *c), consumers)))
        info = job_info(server.target, "tp")
    for rank in range(2):
        primary, other = received[(rank, 0)], received[(rank, 1)]
        assert [step for step, _ in primary] == [step for step, _ in other] and primary
        for (_, packs), (_, same) in zip(primary, other):
            for (keys, tensors), (same_keys, same_tensors) in zip(packs, same):
                assert keys == same_keys and tensors.keys() == same_tensors.keys()
                assert all(torch.equal(tensors[name], same_tensors[name]) for name in tensors)
    assert [(s, [k for k, _ in p]) for s, p in alone] == [(s, [k for k, _ in p]) for s, p in received[(0, 1)]]
    delivered = sum(len(keys) for rank in range(2) for _, packs in received[(rank, 0)] for keys, _ in packs)
    assert sum(info.samples_by_dataset.values()) == delivered  # replica 0 only, once per DP rank
    last = received[(0, 0)][-1][0]
    assert all((r.acked_epoch, r.acked_step) == (0, last) for r in info.ranks)


def test_replicas_hold_leases_of_their_own_and_bad_numbers_are_refused(small_tile_index):
    with LocalServer(small_tile_index, workers=1) as server:
        with PackStream(server.target, job="own", rank=1, dp=2, microbatches=2, replica=1, replicas=2) as replica:
            next(iter(replica))
            with PackStream(server.target, job="own", rank=1, dp=2, microbatches=2, replica=0, replicas=2) as primary:
                assert next(iter(primary)).step == 0  # replica 1's lease is not the rank's: not in the way
        with grpc.insecure_channel(server.target) as channel:
            for replica, replicas in ((2, 2), (0, 5000)):
                call = pb_grpc.PackfeedStub(channel).StreamPacks(pb.StreamPacksRequest(
                    job="own", rank=0, replica=replica, replicas=replicas))
                with pytest.raises(grpc.RpcError) as refused:
                    next(iter(call))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "0 <= replica < replicas" in refused.value.details()
    with pytest.raises(ValueError, match="0 <= replica < replicas"):
        PackStream("127.0.0.1:1", job="x", rank=0, replica=2, replicas=2)


def test_replicas_of_one_rank_on_two_servers_do_not_fight_over_a_lease(small_tile_index, tmp_path):
    """Through a real Redis, two servers: one streams rank 1's replica 1, the other its replica 0 at the same
    time; a rank's own lease stays exclusive (a second server asking for replica 1 is refused)."""
    from redis_server import RedisProcess

    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url}
    try:
        with LocalServer(small_tile_index, workers=1, env=env) as first, \
                LocalServer(small_tile_index, workers=1, env=env) as second:
            options = dict(job="shared", rank=1, dp=2, microbatches=2, replicas=2, retries=0, epochs=50, prefetch=1)
            with PackStream(first.target, replica=1, **options) as replica:
                held = next(iter(replica))
                with PackStream(second.target, replica=0, **options) as primary:
                    assert next(iter(primary)).sample_keys == held.sample_keys
                with PackStream(second.target, replica=1, **options) as intruder:
                    with pytest.raises(Exception, match="rank 1 replica 1 of job 'shared' is being served"):
                        next(iter(intruder))
    finally:
        redis.stop()


def test_replicas_running_together_share_each_step_instead_of_preparing_it_twice(small_tile_index):
    """Two replicas of one rank consumed in lockstep (as a TP group's ranks do): the server prepares each step
    about once (`packfeed_steps_shared` counts the steps one replica took from the other's preparation), every
    stream still takes every step (prepared + shared = steps x replicas), and the packs are identical."""
    import threading

    from ports import free_port
    from test_hostile import metric

    lockstep = threading.Barrier(2, timeout=60)

    def consume(target: str, replica: int) -> list:
        out = []
        with PackStream(target, job="tp-shared", rank=0, dp=1, microbatches=2, replica=replica, replicas=2) as stream:
            for step in stream:
                out.append([(pack.sample_keys, pack.pixels.clone()) for pack in step.packs])
                lockstep.wait()
        return out

    port = free_port()
    with LocalServer(small_tile_index, workers=2, metrics_port=port) as server:
        server.metrics_port = port
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(lambda replica: consume(server.target, replica), range(2))
        prepared, shared = metric(server, "packfeed_steps_prepared_total"), metric(server, "packfeed_steps_shared_total")
    steps = len(first)
    assert steps > 4 and len(second) == steps
    for packs, same in zip(first, second):
        assert [keys for keys, _ in packs] == [keys for keys, _ in same]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(packs, same))
    assert prepared + shared == 2 * steps
    assert shared >= steps // 2, (prepared, shared, steps)
