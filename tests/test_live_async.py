"""Asynchronous RL on a live job without a server (docs/live.md "Asynchronous RL"): the versions steps train at,
admission under staleness wait (reservations, earliest deadline first, a step waiting for what is due at it),
whole groups and filter_groups, rollouts put in parts and claimed, across a re-read of the spool, and producers
that go away."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_live_steps import live, message, rules, tensor

from packfeed.server.live.samples import checked_sample
from packfeed.server.live.versions import PolicyVersions
from packfeed.v1.options import PlanConfig

WAIT = PlanConfig(dp=1, live=True, step_samples=4, staleness="wait", max_staleness=1)


def rollout(sample_id: str, version: int = 0, group: str = "g", n: int = 6, reward: float | None = None, **fields):
    out = message(sample_id, n, version, group=group, **fields)
    if reward is not None:
        out.values["reward"] = reward
    return checked_sample(out, rules())


def part(sample_id: str, number: int, tokens: list[int], versions: list[int], unfinished: bool, group: str = "g"):
    """Part `number` of a rollout: its tokens so far, each token's version; a mask of ones, advantages of zeros."""
    out = message(sample_id, len(tokens), 0, group=group, tokens=tokens, loss_mask=[1] * len(tokens),
                  tensors={"advantages": np.zeros(len(tokens))})
    out.token_versions.CopyFrom(tensor(versions, np.int64))
    out.unfinished, out.part = unfinished, number
    return checked_sample(out, rules())


# -- versions ------------------------------------------------------------------------------------------------


def test_steps_train_at_one_version_a_step_until_the_trainers_report_theirs():
    versions = PolicyVersions()
    assert [versions.trained_at(s) for s in range(3)] == [0, 1, 2]
    assert versions.report(4, 10)  # after step 4's update the trainers hold version 10 (several updates a step)
    assert versions.current == 10 and versions.trained_at(5) == 10 and versions.trained_at(7) == 12
    assert not versions.report(3, 11)  # an older step's report says nothing new
    assert versions.deadline(10, 2) == 7  # version 10 is within 2 of the versions steps 5..7 train at


def test_a_reported_version_is_what_the_next_step_is_planned_for_and_is_recovered(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=2, max_staleness=2))
    steps.put([rollout("a"), rollout("b")])  # step 0, trained by version 0
    steps.report_version(0, 5)  # the trainers did five updates on step 0
    steps.put([rollout("c", 2), rollout("d", 5), rollout("e", 4)])  # step 1 trains at version 5: c (age 3) drops
    assert steps.record(1)["version"] == 5 and steps.record(1)["dropped"] == ["c"]
    assert steps.status()["trained_age"] == {0: 3, 1: 1}  # a and b by version 0, d and e by version 5
    steps.reload()  # another server: the next step is planned for the version after the last recorded
    assert steps.versions.trained_at(2) == 6 and steps.status()["dropped_stale"] == 1


# -- admission (staleness wait) ------------------------------------------------------------------------------


def test_reservations_are_granted_while_every_sample_can_train_within_max_staleness(tmp_path):
    steps = live(tmp_path, WAIT)
    # version 0 trains within 1 of steps 0 and 1: 8 samples of room
    assert steps.reserve("p1", "g1", 4, None) == (True, 0, "")
    assert steps.reserve("p1", "g2", 4, None)[0]
    granted, version, why = steps.reserve("p2", "g3", 1, None)
    assert not granted and "the steps 0 to 1" in why and "hold 8 samples and 8 are pending or reserved" in why
    assert steps.reserve("p1", "g1", 4, None)[0]  # a retried reservation is the same grant
    assert "reserved by producer p1" in steps.reserve("p2", "g1", 4, None)[2]
    steps.put([rollout(f"g1-{i}", group="g1") for i in range(4)], producer="p1")  # step 0 forms
    assert steps.formed == 1 and steps.status()["reservations"] == 1
    assert not steps.reserve("p2", "g3", 1, None)[0]  # still full: step 1 holds g2's four
    steps.release(0)  # the trainers took step 0: version 1 now, and step 2 trains it within 1 too
    assert steps.versions.current == 1 and steps.reserve("p2", "g3", 4, None) == (True, 1, "")
    too_old = steps.reserve("p3", "g4", 1, -5)
    assert not too_old[0] and "policy version -5 is too old" in too_old[2]


def test_a_step_waits_for_the_reservation_due_at_it_and_takes_the_oldest_version_first(tmp_path):
    steps = live(tmp_path, WAIT)
    assert steps.reserve("slow", "old", 2, 0)[0]  # due by step 1 (version 0 + 1)
    steps.put([rollout(f"a{i}", 0, group="a") for i in range(4)])  # step 0: four others (room for two steps)
    assert steps.formed == 1
    steps.put([rollout(f"b{i}", 1, group="b") for i in range(4)])  # step 1 is old's last chance: it waits
    assert steps.formed == 1 and "waits for 2 sample(s) of 'old'" in steps.waiting_for()
    steps.put([rollout("old-0", 0, group="old"), rollout("old-1", 0, group="old")], producer="slow")
    assert steps.formed == 2 and steps.record(1)["members"][:2] == ["old-0", "old-1"]  # oldest version first
    assert steps.status()["trained_stale"] == 0 and steps.status()["dropped_stale"] == 0


def test_a_gone_producers_reservation_ends_and_the_step_forms(tmp_path):
    steps = live(tmp_path, WAIT)
    steps.heartbeat("slow", "rollout-7", lease_s=0.2)
    assert steps.reserve("slow", "old", 2, 0)[0]
    steps.put([rollout(f"a{i}", 0, group="a") for i in range(8)])  # step 0, and step 1 waits for old
    assert steps.formed == 1
    time.sleep(0.3)  # its lease lapses
    steps.tick()
    assert steps.formed == 2 and steps.status()["reservations"] == 0


# -- groups --------------------------------------------------------------------------------------------------


def test_a_step_takes_whole_groups_and_filter_groups_drops_the_uniform_ones(tmp_path):
    config = PlanConfig(dp=1, live=True, step_samples=4, group_size=2, filter_groups="reward")
    steps = live(tmp_path, config)
    steps.put([rollout("x0", group="x", reward=1.0), rollout("y0", group="y", reward=0.0)])
    assert steps.formed == 0  # neither group is whole
    steps.put([rollout("x1", group="x", reward=1.0), rollout("y1", group="y", reward=1.0)])  # x all equal
    assert steps.formed == 0 and steps.status()["pending"] == 4
    steps.put([rollout("z0", group="z", reward=0.2), rollout("z1", group="z", reward=0.7)])
    record = steps.record(0)
    assert record["members"] == ["y0", "y1", "z0", "z1"] and record["filtered"] == ["x0", "x1"]
    assert steps.status()["groups_filtered"] == 1
    refused = steps.put([rollout("w0", group="w")])
    assert refused[0][0] == "refused" and "filter_groups" in refused[0][1]


def test_a_group_past_its_deadline_is_taken_short_and_counted(tmp_path):
    config = PlanConfig(dp=1, live=True, step_samples=2, group_size=4, group_timeout_s=0.2)
    steps = live(tmp_path, config)
    steps.put([rollout("q0", group="q"), rollout("q1", group="q")])
    assert steps.formed == 0
    time.sleep(0.3)
    steps.tick()
    assert steps.formed == 1 and steps.record(0)["members"] == ["q0", "q1"] and steps.status()["groups_short"] == 1


# -- partial rollouts ----------------------------------------------------------------------------------------


def test_a_rollout_put_in_parts_is_claimed_once_continued_and_trained_once(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=1))
    assert steps.put([part("r", 0, [11, 12, 13], [3, 3, 3], unfinished=True)], producer="p1")[0][0] == "accepted"
    assert steps.formed == 0 and steps.status()["partials"] == 1  # kept, not trained
    row, arrays, _ = steps.claim_rollout("p2", None)
    assert row.id == "r" and arrays["tokens"].tolist() == [11, 12, 13] and arrays["token_versions"].tolist() == [3] * 3
    assert steps.claim_rollout("p3", None)[0] is None  # one producer at a time
    assert steps.claim_rollout("p2", None)[0].id == "r"  # a retried claim is the same rollout
    stale = steps.put([part("r", 1, [11, 99, 13, 14], [3, 3, 3, 4], unfinished=False)])[0]
    assert stale[0] == "refused" and "must start with its part 0" in stale[1]
    done = part("r", 1, [11, 12, 13, 14, 15], [3, 3, 3, 4, 4], unfinished=False)
    assert steps.put([done], producer="p2")[0][0] == "accepted"
    assert steps.record(0)["members"] == ["r"] and steps.rows["r"].policy_version == 4
    assert steps.put([done])[0][0] == "duplicate"  # its retry
    assert steps.put([part("r", 0, [11, 12, 13], [3, 3, 3], unfinished=True)])[0][0] == "duplicate"
    other = steps.put([part("r", 1, [11, 12, 13, 17], [3, 3, 3, 5], unfinished=False)])[0]
    assert other[0] == "refused" and "finished by its part 1" in other[1]
    assert steps.status()["partials"] == 0 and steps.arrived == 1


def test_an_unfinished_rollout_survives_a_reread_of_the_spool_and_a_dead_claimant(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=1))
    steps.put([part("r", 0, [11, 12], [0, 0], unfinished=True)])
    steps.heartbeat("p1", lease_s=0.2)
    assert steps.claim_rollout("p1", None)[0] is not None
    steps.put([part("r", 1, [11, 12, 13], [0, 0, 1], unfinished=True)], producer="p1")  # interrupted again
    time.sleep(0.3)
    steps.tick()
    steps.reload()  # a restarted server: part 1 is the rollout, part 0 is superseded
    assert list(steps.partials.rows) == ["r"] and steps.partials.rows["r"].part == 1
    row, arrays, _ = steps.claim_rollout("p2", None)
    assert arrays["tokens"].tolist() == [11, 12, 13] and arrays["token_versions"].tolist() == [0, 0, 1]
    steps.put([part("r", 2, [11, 12, 13, 14], [0, 0, 1, 2], unfinished=False)], producer="p2")
    steps.reload()
    assert steps.formed == 1 and steps.record(0)["members"] == ["r"] and not steps.partials.rows
    steps.release(0)  # every part's batch goes once its rollout was consumed
    assert not list((tmp_path / steps.spool.dir.rsplit("/", 1)[-1] / "batches").glob("*.tar"))


def test_token_versions_must_match_the_tokens_and_the_sample_version():
    bad = message("v", 3, 7, tokens=[1, 2, 3], loss_mask=[1, 1, 1], tensors={})
    bad.token_versions.CopyFrom(tensor([1, 2, 3], np.int64))
    with pytest.raises(Exception, match="newest of its token_versions"):
        checked_sample(bad, rules())
    bad.token_versions.CopyFrom(tensor([1, 2], np.int64))
    with pytest.raises(Exception, match="one per token"):
        checked_sample(bad, rules())


# -- producers -----------------------------------------------------------------------------------------------


def test_producers_gone_names_the_job_and_its_producers_after_the_timeout(tmp_path):
    config = PlanConfig(dp=1, live=True, step_samples=4, producer_timeout_s=0.3)
    steps = live(tmp_path, config)
    steps.heartbeat("p1", "rollout host a", lease_s=0.2)
    steps.put([rollout("a")], producer="p1")
    assert steps.producers_gone() == "" and steps.status()["producers_alive"] == 1
    time.sleep(0.4)
    gone = steps.producers_gone()
    assert "producer_timeout_s 0.3" in gone and "p1 (rollout host a) last seen" in gone
    assert steps.status()["producers_alive"] == 0 and steps.waiting_for() == "no producer is alive"
    steps.put([rollout("b")], producer="p1")  # back: the stream would wait on
    assert steps.producers_gone() == ""


def test_a_part_put_on_a_full_disk_keeps_nothing_and_its_retry_trains_it_once(tmp_path):
    """The disk fills as a rollout's continuation is put: its rows cannot be written, so nothing of it is kept and
    the unfinished part stays in the pool, claimed as before; then the step it completes cannot be recorded: it is
    kept, the retry is a duplicate and forms the step. Trained once, and a re-read of the spool agrees."""
    from test_live_steps import failing_writes

    from packfeed.server.live.spool import SpoolError
    from packfeed.server.live.steps import StepNotRecorded

    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=1))
    steps.put([part("r", 0, [11, 12], [0, 0], unfinished=True)])
    assert steps.claim_rollout("p1", None)[0].id == "r"
    done = part("r", 1, [11, 12, 13], [0, 0, 1], unfinished=False)
    failing_writes(steps, "batches/", ".json")
    with pytest.raises(SpoolError, match="No space left"):
        steps.put([done], producer="p1")
    assert steps.partials.rows["r"].part == 0 and steps.partials.claims == {"r": "p1"} and not steps.pending
    failing_writes(steps, "steps/")
    with pytest.raises(StepNotRecorded, match="samples are kept"):
        steps.put([done], producer="p1")
    assert steps.formed == 0 and list(steps.pending) == ["r"] and not steps.partials.rows
    assert steps.put([done], producer="p1")[0][0] == "duplicate"
    assert steps.formed == 1 and steps.record(0)["members"] == ["r"]
    again = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=1))
    assert again.formed == 1 and again.record(0)["members"] == ["r"] and not again.partials.rows
