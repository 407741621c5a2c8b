"""A live job's samples and steps without a server: the checks a put runs, the spool, step formation, staleness,
the end, recovery from the spool after a crash, and release of what every rank consumed."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from packfeed.media.image_policy import policy_from_dict
from packfeed.server.live.rows import LiveRow
from packfeed.server.live.samples import Refused, SampleRules, checked_sample
from packfeed.server.live.spool import Spool, SpoolError, SpoolFull, job_folder, read_array
from packfeed.server.live.step_plan import live_fingerprint
from packfeed.server.live.steps import LiveClosed, LiveSteps
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.options import PlanConfig

CONTEXT = 7  # the image placeholder token of these tests
POLICY = policy_from_dict({"name": "internvl", "image_size": 112, "tokens_per_tile": 16, "max_num": 4})
PROMPTS = {"prompt-a": (3, [(224, 112)])}  # key -> (sample id, image sizes)


def rules(**overrides) -> SampleRules:
    values = dict(vocab_size=1000, image_context_id=CONTEXT, policy=POLICY, prompt_images=PROMPTS.get)
    return SampleRules(**{**values, **overrides})


def tensor(values, dtype) -> pb.Tensor:
    array = np.asarray(values, dtype=dtype)
    return pb.Tensor(dtype=array.dtype.name, shape=[len(array)], data=array.tobytes())


def message(sample_id: str, n: int = 10, version: int = 0, group: str = "g", **fields) -> pb.LiveSample:
    out = pb.LiveSample(id=sample_id, group=group, policy_version=version, prompt=fields.pop("prompt", ""),
                        images=fields.pop("images", []))
    out.tokens.CopyFrom(tensor(fields.pop("tokens", np.arange(20, 20 + n)), np.int32))
    out.loss_mask.CopyFrom(tensor(fields.pop("loss_mask", [0] * (n // 2) + [1] * (n - n // 2)), np.uint8))
    for name, values in fields.pop("tensors", {"advantages": np.linspace(-1, 1, n)}).items():
        out.tensors[name].CopyFrom(tensor(values, np.float32))
    assert not fields
    return out


def sample(sample_id: str, n: int = 10, version: int = 0, **fields):
    return checked_sample(message(sample_id, n, version, **fields), rules())


def live(tmp_path, config: PlanConfig, **bounds) -> LiveSteps:
    spool = Spool(tmp_path, "job-1", json.dumps({"plan": config.to_dict()}))
    return LiveSteps(spool, config, 0, live_fingerprint(config, 0, "index"), **bounds)


def row_of(steps: LiveSteps, sample_id: str) -> LiveRow:
    return steps.rows[sample_id]


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


# -- checks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field, reason", [
    ({"tokens": [5, 1000, 3]}, "tokens", "outside the vocabulary"),
    ({"tokens": [5, -1, 3]}, "tokens", "outside the vocabulary"),
    ({"loss_mask": [1, 1]}, "loss_mask", "one 0 or 1 per token"),
    ({"tensors": {"advantages": [0.5] * 3}}, "tensors[advantages]", "3 values for 10 tokens"),
    ({"tensors": {"advantages": [float("nan")] * 10}}, "tensors[advantages]", "NaN"),
    ({"tensors": {"bad name!": [0.0] * 10}}, "tensors", "letters, digits and underscores"),
    ({"prompt": "nowhere"}, "prompt", "no indexed sample 'nowhere'"),
    ({"images": [b"not an image"]}, "images[0]", "not a usable image file: not an image"),
    ({"images": [png(112, 112)]}, "tokens", "image placeholders"),  # the image's 16 placeholders are missing
    ({"prompt": "prompt-a"}, "tokens", "image placeholders"),
])
def test_a_bad_sample_is_refused_with_its_field_and_reason(fields, field, reason):
    with pytest.raises(Refused, match=reason) as refused:
        checked_sample(message("s", 10, **fields), rules())
    assert refused.value.field == field


def test_images_are_costed_from_their_placeholders_and_sizes():
    image = png(224, 112)  # two 112 px tiles and a thumbnail under InternVL tiling: 3 x 16 placeholders
    tokens = [1, 2] + [CONTEXT] * 48 + [3, 4]
    by_file = checked_sample(message("a", len(tokens), tokens=tokens, images=[image]), rules())
    by_reference = checked_sample(message("b", len(tokens), tokens=tokens, prompt="prompt-a"), rules())
    assert by_file.sizes == by_reference.sizes == [(224, 112)]
    assert by_file.vision == by_reference.vision == POLICY.cost(224, 112, 1).units > 0
    assert by_reference.prompt_id == 3 and by_file.pixel_bytes == 3 * 3 * 112 * 112
    with pytest.raises(Refused, match="over the job's vision cap"):
        checked_sample(message("c", len(tokens), tokens=tokens, images=[image]), rules(max_vision=1))
    with pytest.raises(Refused, match="its token cap under oversize skip"):
        checked_sample(message("d", 30), rules(max_tokens=20))


def test_a_spooled_row_is_a_typed_record_that_reads_back_the_spools_json(tmp_path):
    """A live row goes to its batch's rows file as JSON and comes back equal; a row a spool wrote before digests,
    prefixes and tokened tar names (none of those keys) reads with their defaults."""
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=8))
    steps.put([sample("a", 58, prompt="prompt-a", tokens=[1, 2] + [CONTEXT] * 48 + [3, 4] + [5] * 6,
                      loss_mask=[0] * 52 + [1] * 6), sample("b", 12)])
    rows = [row_of(steps, "a"), row_of(steps, "b")]
    assert [LiveRow.from_json(json.loads(json.dumps(row.to_json()))) for row in rows] == rows
    assert rows[0].prefix == 52 and rows[0].sizes == ((224, 112),) and rows[0].prompt_id == 3
    assert {"key", "n_images", "members", "file"} <= set(rows[1].to_json())  # the keys spools always held
    old = {k: v for k, v in rows[1].to_json().items() if k not in ("digest", "prefix", "prefix_key", "file")}
    assert LiveRow.from_json(old) == dataclasses.replace(rows[1], digest="", prefix=0, prefix_key="", file="")


def test_a_sample_without_a_loss_mask_is_trained_on_every_token():
    bare = message("s", 6)
    bare.ClearField("loss_mask")
    assert checked_sample(bare, rules()).loss_tokens == 6


# -- steps ---------------------------------------------------------------------------------------------------


def test_steps_form_in_arrival_order_every_sample_once(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=2, live=True, step_samples=4))
    outcomes = steps.put([sample(f"s{i}") for i in range(10)])
    assert [outcome for outcome, _ in outcomes] == ["accepted"] * 10
    assert steps.formed == 2 and len(steps.pending) == 2
    assert [steps.record(s)["members"] for s in range(2)] == [[f"s{i}" for i in range(4)],
                                                              [f"s{i}" for i in range(4, 8)]]
    steps.put([sample("s10")], end=True)  # the end: what is pending forms the last step
    assert steps.ended and steps.record(2) == {"members": ["s8", "s9", "s10"], "dropped": [], "last": True,
                                            "version": 2, "ages": {"2": 3}}  # trained by version 2, age 2
    with pytest.raises(LiveClosed, match="ended at step 2"):
        steps.put([sample("late")])
    members = [m for s in range(3) for m in steps.record(s)["members"]]
    assert sorted(members) == sorted(f"s{i}" for i in range(11))


def test_a_step_forms_on_tokens_and_the_end_forms_an_empty_last_step_when_nothing_is_pending(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_tokens=25))
    steps.put([sample("a", 10), sample("b", 10)])
    assert steps.formed == 0  # 20 tokens
    steps.put([sample("c", 10), sample("d", 10)])
    assert steps.formed == 1 and steps.record(0)["members"] == ["a", "b", "c"]  # the sample reaching 25 included
    steps.put([sample("e", 30)], end=False)
    assert steps.formed == 2 and steps.record(1)["members"] == ["d", "e"]
    steps.put([], end=True)
    assert steps.record(2) == {"members": [], "dropped": [], "last": True, "version": 2, "ages": {}} and steps.plan(2) is None


def test_a_job_of_n_steps_ends_at_its_last(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=2, steps=2))
    steps.put([sample(f"s{i}") for i in range(5)])
    assert steps.formed == 2 and steps.ended and steps.is_last(1) and not steps.is_last(0)
    assert list(steps.pending) == ["s4"]  # accepted in the put that ended it: never in a step


def test_stale_samples_are_dropped_and_counted_once(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=2, max_staleness=1))
    steps.put([sample("a", version=0), sample("b", version=0)])  # step 0
    steps.put([sample("c", version=0), sample("d", version=1), sample("e", version=0), sample("f", version=1)])
    assert steps.record(1) == {"members": ["c", "d"], "dropped": [], "last": False, "version": 1,
                               "ages": {"0": 1, "1": 1}}  # 1 - 0 <= 1
    steps.put([sample("g", version=2)])  # step 2 takes f (2 - 1 <= 1) and g, e (2 - 0 > 1) is dropped
    assert steps.record(2) == {"members": ["f", "g"], "dropped": ["e"], "last": False, "version": 2,
                               "ages": {"0": 1, "1": 1}}
    assert steps.status()["dropped_stale"] == 1


def test_retries_and_other_tensor_names(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=100))
    steps.put([sample("a"), sample("b")])
    outcomes = steps.put([sample("a"), sample("c"), sample("c"), sample("d", tensors={"logp": [0.0] * 10}),
                          Refused("tokens", "bad")])
    assert [o for o, _ in outcomes] == ["duplicate", "accepted", "duplicate", "refused", "refused"]
    assert "the job's samples carry ['advantages']" in outcomes[3][1]
    assert list(steps.pending) == ["a", "b", "c"]


def test_a_step_plan_holds_every_member_in_one_step_and_is_a_function_of_its_members(tmp_path):
    config = PlanConfig(dp=2, microbatches=1, live=True, step_samples=40, token_cap=64, vision_cap=64)
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 60, 40)
    runs = []
    for name in ("one", "two"):
        steps = live(tmp_path / name, config)
        steps.put([sample(f"s{i}", int(n), group="") for i, n in enumerate(lengths)])  # each alone: no prefix shared
        plan = steps.plan(0)
        assert plan.n_steps == 1 and plan.config.microbatches > 1  # 40 samples need more than 2 packs of 64
        assert sorted(plan.members.tolist()) == list(range(40))
        assert max(lengths[plan.members[a:b]].sum() for a, b in zip(plan.offsets[:-1], plan.offsets[1:])) <= 64
        runs.append(plan.fingerprint())
    assert runs[0] == runs[1]


# -- the spool -----------------------------------------------------------------------------------------------


def test_a_server_reopening_the_spool_loses_and_repeats_nothing(tmp_path):
    config = PlanConfig(dp=2, live=True, step_samples=3)
    first = live(tmp_path, config)
    first.put([sample(f"s{i}", 5 + i) for i in range(7)])
    plans = [first.plan(s).fingerprint() for s in range(2)]
    folder = Path(job_folder(tmp_path, "job-1"))
    (folder / "batches" / "000000000099.tar").write_bytes(b"a put that never answered")
    again = live(tmp_path, config)
    assert not (folder / "batches" / "000000000099.tar").exists()
    assert again.formed == 2 and list(again.pending) == ["s6"]
    assert [again.plan(s).fingerprint() for s in range(2)] == plans
    assert [o for o, _ in again.put([sample("s3", 8), sample("s7"), sample("s8")])] == \
        ["duplicate", "accepted", "accepted"]
    assert again.record(2)["members"] == ["s6", "s7", "s8"]


def test_steps_a_crash_left_unformed_are_formed_on_reopening(tmp_path):
    config = PlanConfig(dp=1, live=True, step_samples=2)
    first = live(tmp_path, config)
    first.put([sample("a"), sample("b"), sample("c")])
    step_file = Path(job_folder(tmp_path, "job-1")) / "steps" / "000000000000.json"
    step_file.unlink()  # killed between writing the batch and recording its step
    assert live(tmp_path, config).record(0)["members"] == ["a", "b"]


def test_what_every_rank_consumed_leaves_the_spool(tmp_path):
    config = PlanConfig(dp=1, live=True, step_samples=2)
    steps = live(tmp_path, config)
    for start in range(0, 6, 2):
        steps.put([sample(f"s{start}"), sample(f"s{start + 1}")])
    batches = Path(job_folder(tmp_path, "job-1")) / "batches"
    assert len(list(batches.glob("*.tar"))) == 3
    steps.release(1)
    [left] = batches.glob("*.tar")
    assert left.name.startswith("000000000003.") and steps.spool.bytes == left.stat().st_size
    with pytest.raises(KeyError, match="acknowledged by every rank"):
        steps.plan(0)
    again = live(tmp_path, config)
    assert again.formed == 3 and again.plan(2) is not None
    assert [o for o, _ in again.put([sample("s0")])] == ["duplicate"]  # consumed long ago: still not stored twice


def test_a_full_spool_keeps_nothing_of_the_put(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=100), max_bytes=20_000)
    steps.put([sample(f"s{i}") for i in range(3)])
    with pytest.raises(SpoolFull, match="live-spool-max-gb"):
        steps.put([sample(f"t{i}", 200) for i in range(10)])
    with pytest.raises(ValueError, match="larger than the job's whole spool may hold"):
        steps.put([sample(f"t{i}", 200) for i in range(20)])  # could never fit: no use waiting
    assert list(steps.pending) == ["s0", "s1", "s2"]
    counted = live(tmp_path / "other", PlanConfig(dp=1, live=True, step_samples=100), max_samples=3)
    counted.put([sample(f"s{i}") for i in range(3)])
    with pytest.raises(SpoolFull, match="live-max-samples"):
        counted.put([sample("s3")])


def test_a_spool_of_another_job_with_the_same_id_is_refused(tmp_path):
    live(tmp_path, PlanConfig(dp=1, live=True, step_samples=2))
    with pytest.raises(SpoolError, match="other settings"):
        live(tmp_path, PlanConfig(dp=2, live=True, step_samples=2))


@pytest.mark.slow
def test_a_spool_in_an_object_store(tmp_path):
    """s3://: every file one PUT, listings asked of the store; a second LiveSteps over the same prefix (a restarted
    or another server) finds the job as it was left, and released batches leave the bucket."""
    from s3_server import S3Server, running
    from packfeed.media.storage import filesystem

    with running(S3Server()):
        filesystem("s3://live").mkdir("live")
        config = PlanConfig(dp=1, live=True, step_samples=2)

        def opened() -> LiveSteps:
            spool = Spool("s3://live/spool", "job-1", json.dumps({"plan": config.to_dict()}))
            return LiveSteps(spool, config, 0, live_fingerprint(config, 0, "index"))

        first = opened()
        first.put([sample(f"s{i}", 8 + i) for i in range(4)])
        first.put([sample("s4", 12)])
        again = opened()
        assert again.formed == 2 and list(again.pending) == ["s4"]
        assert again.plan(1).fingerprint() == first.plan(1).fingerprint()
        row = again.member_rows(1, [0])[0]  # what a worker reads, by range
        assert read_array(again.spool.tar_path(row), row.members["tokens"]).tolist() == \
            list(range(20, 30))
        again.release(1)  # the first put's batch is consumed, the second's s4 is not
        batches = again.spool.dir + "/batches"
        filesystem(batches).invalidate_cache()
        assert {name.rsplit("/", 1)[1] for name in filesystem(batches).ls(batches)} == \
            {"000000000002.json", row_of(again, "s4").file}


def test_a_step_of_text_and_image_samples_is_collective_safe(tmp_path):
    """Every rank's pack of a microbatch calls the vision tower, or none does: FSDP / ZeRO-3 with the tower
    wrapped apart never waits on a rank that skips it (the hang text-only steps cause elsewhere)."""
    config = PlanConfig(dp=2, microbatches=2, live=True, step_samples=16, token_cap=256, vision_cap=64)
    steps = live(tmp_path, config)
    image = png(112, 112)  # one 112 px tile: 16 placeholders
    tokens = [1, 2] + [CONTEXT] * 16 + list(range(20, 40))
    with_images = [checked_sample(message(f"i{k}", len(tokens), tokens=tokens, images=[image]), rules())
                   for k in range(8)]  # one group with one prompt: cut where that aligns the towers
    steps.put([sample(f"t{k}", 30 + k) for k in range(8)] + with_images)
    plan = steps.plan(0)
    assert plan.n_steps == 1
    m = plan.config.microbatches
    calls = []  # per pack in plan order (rank-major within the step): does it call the vision tower?
    for a, b in zip(plan.offsets[:-1], plan.offsets[1:]):
        calls.append(any(row.vision for row in steps.member_rows(0, plan.members[a:b])))
    for microbatch in range(m):
        assert calls[microbatch] == calls[m + microbatch], f"microbatch {microbatch}: {calls}"
    assert any(calls) and not all(calls)  # both kinds of microbatch in the step


# -- groups sharing a prompt ([4/6]) -------------------------------------------------------------------------


def test_a_groups_responses_share_their_prompt_and_are_planned_together(tmp_path):
    """A group's samples with the same prompt (tokens before the first loss token, images) share it: one pack
    holds them, the prompt counted once; the same group label with another prompt, or a sample whose image lies
    after its prompt, shares nothing."""
    config = PlanConfig(dp=2, live=True, step_samples=30, token_cap=400, vision_cap=64)
    prompt = [CONTEXT] * 48 + list(range(40, 60))  # prompt-a's image (48 placeholders under POLICY), then text
    samples = []
    for g in range(3):
        for k in range(8):
            response = list(range(100 + g, 100 + g + 5 + k))
            tokens = (prompt if g < 2 else list(range(300, 320))) + response
            prompt_len = len(tokens) - len(response)
            samples.append(sample(f"g{g}-{k}", len(tokens), group=f"group-{g % 2}", tokens=tokens,
                                  loss_mask=[0] * prompt_len + [1] * len(response),
                                  tensors={}, **({"prompt": "prompt-a"} if g < 2 else {})))
    late_image = sample("late", 56, group="group-0", prompt="prompt-a", tensors={},
                        tokens=list(range(40, 44)) + [CONTEXT] * 48 + list(range(50, 54)),
                        loss_mask=[0] * 2 + [1] * 54)
    keys = {s.prefix_key for s in samples[:8]}
    assert len(keys) == 1 and samples[0].prefix == len(prompt) and samples[16].prefix_key not in keys
    assert samples[8].prefix_key in keys  # group-1 asks the same prompt, but is another group
    assert late_image.prefix_key == "" and late_image.prefix == 0
    steps = live(tmp_path, config)
    steps.put(samples)
    steps.put([late_image] + [sample(f"pad{k}", 10, group="", tensors={}) for k in range(5)])
    plan = steps.plan(0)
    assert plan.groups is not None
    rows = steps.member_rows(0, plan.members.tolist())
    by_member = dict(zip(plan.members.tolist(), rows))
    packs = [plan.members[a:b].tolist() for a, b in zip(plan.offsets[:-1], plan.offsets[1:])]
    for g in range(3):
        ids = [m for m, row in by_member.items() if row.id.startswith(f"g{g}-")]
        holding = {p for p, pack in enumerate(packs) for m in pack if m in ids}
        assert len(holding) == 1, (g, holding)  # 8 responses of under 80 tokens after one prompt fit 400
    alone = live(tmp_path / "alone", PlanConfig(dp=2, live=True, step_samples=30, token_cap=400, vision_cap=64,
                                                shared_prefix=False))
    alone.put(samples)
    alone.put([late_image] + [sample(f"pad{k}", 10, group="", tensors={}) for k in range(5)])
    assert alone.plan(0).groups is None


def test_a_mixtures_prompts_are_found_in_each_index_and_a_key_two_hold_is_refused(tmp_path):
    """A live job over a mixture (GRPO's prompts drawn from several datasets): a prompt key is looked up in every
    index, numbered over them in order and read back from its own; a key two indexes hold is refused at its put."""
    import yaml

    from hf_models import family_dataset
    from packfeed.server.serve.config import MixtureSource
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.live_reads import LiveReads
    from packfeed.server.serve.live_source import LiveDataset

    for name, (samples, prefix) in {"a": (3, ""), "b": (2, ""), "c": (2, "c-")}.items():
        family_dataset(tmp_path / name, "qwen2_vl", samples=samples, prefix=prefix, image_counts=(1, 0))
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"name": "mix", "datasets": {
        name: {"index": f"{name}/index.parquet"} for name in "abc"}}))
    live = LiveDataset(Dataset.open("mix", MixtureSource(str(tmp_path / "mix.yaml"))), steps=None)
    assert live.offsets == (0, 3, 5)
    found = {key: live.prompt_images(key) for key in ("s0", "s1", "s2", "c-s0", "c-s1", "nowhere")}
    assert found["s0"] is None and found["s1"] is None and found["nowhere"] is None  # in a and b: which one?
    assert found["s2"][0] == 2 and found["c-s0"][0] == 5 and found["c-s1"][0] == 6
    assert len(found["c-s0"][1]) == 1 and found["c-s1"][1] == []  # its own images: c's sample 0 holds one
    where = LiveReads({}, 0, offsets=live.offsets)
    assert [where.prompt_of(n) for n in (2, 3, 5, 6)] == [(0, 2), (1, 0), (2, 0), (2, 1)]
    rules = live.rules(PlanConfig(dp=1, live=True, step_samples=4))
    with pytest.raises(Refused, match="two samples of that key"):
        checked_sample(message("x", prompt="s0"), rules)


# -- faults: every acknowledged sample delivered exactly once ([1/6] of the sixth wave) ---------------------


def failing_writes(steps: LiveSteps, prefix: str, suffix: str = "", times: int = 1) -> list[str]:
    """Make the spool's next `times` writes of files named `prefix`...`suffix` fail as a full disk does (the
    spool's LocalFolder turns the disk's error into this SpoolError); the names it failed, as they fail."""
    store, failed = steps.spool.store, []
    write = store.write

    def flaky(name: str, data: bytes, exclusive: bool = False) -> None:
        if name.startswith(prefix) and name.endswith(suffix) and len(failed) < times:
            failed.append(name)
            raise SpoolError(f"the live spool cannot write {name}: [Errno 28] No space left on device")
        return write(name, data, exclusive)

    store.write = flaky
    return failed


def delivered(steps: LiveSteps) -> list[str]:
    return [m for s in range(steps.formed) for m in steps.record(s)["members"]]


def test_a_step_record_that_fails_to_write_loses_no_acknowledged_sample(tmp_path):
    """The disk is full just as a put forms a step: its batch is written, its step record is not. The put fails
    saying its samples are kept; the retry is answered duplicate and forms the step; nothing was taken off the
    pending queue meanwhile, and a server re-opening the spool finds the same."""
    from packfeed.server.live.steps import StepNotRecorded

    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=4))
    steps.put([sample(f"s{i}") for i in range(3)])
    failed = failing_writes(steps, "steps/")
    with pytest.raises(StepNotRecorded, match="samples are kept"):
        steps.put([sample("s3"), sample("s4")])
    assert failed == ["steps/000000000000.json"] and steps.formed == 0
    assert list(steps.pending) == ["s0", "s1", "s2", "s3", "s4"]
    outcomes = steps.put([sample("s3"), sample("s4")])  # the producer's retry
    assert [o for o, _ in outcomes] == ["duplicate", "duplicate"]
    assert delivered(steps) == ["s0", "s1", "s2", "s3"] and list(steps.pending) == ["s4"]
    steps.put([], end=True)
    assert delivered(steps) == ["s0", "s1", "s2", "s3", "s4"]
    assert delivered(live(tmp_path, PlanConfig(dp=1, live=True, step_samples=4))) == delivered(steps)


def test_a_batch_whose_rows_fail_to_write_wedges_nothing(tmp_path):
    """The disk fills between a put's tar and its rows: the put fails and keeps nothing, the tar it left is no
    other server's and stands in no later put's way; the retry is accepted, and the spool holds one tar per
    batch once a server re-opens it."""
    config = PlanConfig(dp=1, live=True, step_samples=2)
    steps = live(tmp_path, config)
    failing_writes(steps, "batches/", ".json")
    with pytest.raises(SpoolError, match="No space left"):
        steps.put([sample("a"), sample("b")])
    assert steps.formed == 0 and not steps.pending and "a" not in steps.known
    assert [o for o, _ in steps.put([sample("a"), sample("b")])] == ["accepted", "accepted"]
    assert [o for o, _ in steps.put([sample("c"), sample("d")])] == ["accepted", "accepted"]
    assert delivered(steps) == ["a", "b", "c", "d"]
    again = live(tmp_path, config)
    batches = Path(job_folder(tmp_path, "job-1")) / "batches"
    assert len(list(batches.glob("*.tar"))) == len(list(batches.glob("*.json"))) == 2
    assert delivered(again) == ["a", "b", "c", "d"]


def test_a_released_record_that_fails_to_write_removes_no_batch_early(tmp_path):
    """`released.json` cannot be written on a full disk: the steps stay counted once, so the batch a later
    step still needs stays (a second count would remove it before that step is served)."""
    config = PlanConfig(dp=1, live=True, step_samples=2)
    steps = live(tmp_path, config)
    steps.put([sample(f"s{i}") for i in range(3)])  # one batch: step 0 takes s0, s1; s2 waits
    failing_writes(steps, "released.json", times=5)
    steps.release(0)
    steps.release(0)  # an acknowledgement repeated (a retried AckStep)
    steps.put([sample("s3")])
    assert steps.plan(1) is not None and delivered(steps) == ["s0", "s1", "s2", "s3"]


def test_a_duplicate_id_with_other_content_is_refused_naming_the_id(tmp_path):
    steps = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=100))
    steps.put([sample("a", 10)])
    outcomes = steps.put([sample("a", 10), sample("a", 12), sample("b", 10), sample("b", 11)])
    assert [o for o, _ in outcomes] == ["duplicate", "refused", "accepted", "refused"]
    assert outcomes[1][1].startswith("id: 'a' was accepted before with other content")
    again = live(tmp_path, PlanConfig(dp=1, live=True, step_samples=100))  # the digest is kept in the spool
    assert [o for o, _ in again.put([sample("a", 12), sample("b", 10)])] == ["refused", "duplicate"]


def test_a_spool_is_read_only_by_the_lease_holder(tmp_path):
    """A server that opens the job without its lease reads nothing and removes nothing (another server's put
    in flight may have written its tar and not yet its rows); `reload`, once it holds the lease, reads all."""
    config = PlanConfig(dp=1, live=True, step_samples=2)
    holder = live(tmp_path, config)
    holder.put([sample("a"), sample("b"), sample("c")])
    in_flight = Path(job_folder(tmp_path, "job-1")) / "batches" / "000000000002.feed.tar"
    in_flight.write_bytes(b"a put whose rows are being written")
    spool = Spool(tmp_path, "job-1", json.dumps({"plan": config.to_dict()}))
    standby = LiveSteps(spool, config, 0, live_fingerprint(config, 0, "index"), load=False)
    assert standby.stale and standby.formed == 0 and in_flight.exists()
    holder.put([sample("d")])
    standby.reload()  # the holder is gone: the standby takes the lease
    assert not standby.stale and delivered(standby) == ["a", "b", "c", "d"] and not in_flight.exists()


@pytest.mark.parametrize("kind", ["truncated", "bomb"])
def test_an_image_that_cannot_be_served_is_refused_at_its_put(kind):
    """Every image is decoded whole at its put: a truncated JPEG (its header intact) and a PNG whose header
    declares 100,000 x 100,000 are refused with their field, the samples beside them kept."""
    from packfeed.media.image_policy import lift_pillow_limit

    lift_pillow_limit(POLICY.max_image_pixels)  # as a server does: the policy's limit is the one that holds
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(buffer, "JPEG")
    good = buffer.getvalue()
    if kind == "truncated":
        bad = good[:len(good) // 2]
        assert Image.open(io.BytesIO(bad)).size == (112, 112)  # the header alone passes
    else:
        import zlib

        small = png(1, 1)  # IHDR's width and height declared 100,000 each, its checksum made to match
        header = small[12:16] + (100_000).to_bytes(4, "big") * 2 + small[24:29]
        bad = small[:12] + header + zlib.crc32(header).to_bytes(4, "big") + small[33:]
    tokens = [1, 2] + [CONTEXT] * 16 + list(range(20, 40))
    fine = checked_sample(message("good", len(tokens), tokens=tokens, images=[good]), rules())
    assert fine.sizes == [(112, 112)]
    with pytest.raises(Refused) as refused:
        checked_sample(message("bad", len(tokens), tokens=tokens, images=[good, bad]), rules())
    assert refused.value.field == "images[1]"
    assert ("truncated" in str(refused.value)) if kind == "truncated" else ("max_image_pixels" in str(refused.value))


def test_an_image_over_the_servers_decode_budget_is_refused_at_its_put():
    tokens = [1, 2] + [CONTEXT] * 16 + list(range(20, 40))
    image = png(112, 112)
    assert checked_sample(message("fits", len(tokens), tokens=tokens, images=[image]),
                          rules(decode_budget=112 * 112 * 10, decode_bytes_per_pixel=10)).sizes == [(112, 112)]
    with pytest.raises(Refused, match=r"needs ~0 MiB to decode, more than the server may take") as refused:
        checked_sample(message("over", len(tokens), tokens=tokens, images=[image]),
                       rules(decode_budget=112 * 112 * 10 - 1, decode_bytes_per_pixel=10))
    assert refused.value.field == "images[0]"


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB tmpfs (the test runs as root), unmounted afterwards; skipped where mounting is not allowed."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (the injected failures above cover the same writes)")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_disk_full_at_each_write_of_a_put_loses_no_acknowledged_sample(small_disk):
    """On a real full disk: the free space left before a put that forms a step is swept page by page, so the
    put fails at its tar, at its rows, at its step record, or not at all. Each time the producer retries (as its
    client does) once space is freed, a rank acknowledges on the full disk, and the ledger holds: every sample
    whose put returned is in exactly one step, readable, and a server re-opening the spool finds the same."""
    import os

    config = PlanConfig(dp=1, live=True, step_samples=4)
    failed_at = set()
    for pages in range(24):
        root = small_disk / f"free-{pages}"
        steps = live(root, config)
        steps.put([sample(f"s{i}", 40) for i in range(3)])
        acknowledged = ["s0", "s1", "s2"]
        filler = small_disk / "filler"
        stats = os.statvfs(small_disk)
        with open(filler, "wb") as out:
            out.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - pages * 4096))
        batch = [sample(f"s{i}", 40) for i in range(3, 6)]
        try:
            steps.put(batch)
        except SpoolError as error:
            failed_at.add("step" if "/steps/" in str(error) else "rows" if ".json" in str(error) else "tar")
        steps.release(0)  # an acknowledgement on the full disk (of a step formed or not)
        filler.unlink()
        steps.put(batch)  # the retry: accepted, or duplicate of what the failed put kept
        acknowledged += [s.id for s in batch]
        steps.put([], end=True)
        formed = delivered(steps)
        assert sorted(formed) == sorted(acknowledged) and len(set(formed)) == len(formed), (pages, formed)
        for step in range(1, steps.formed):  # step 0 may be released: its batch consumed
            for row in steps.member_rows(step, range(len(steps.record(step)["members"]))):
                assert read_array(steps.spool.tar_path(row), row.members["tokens"]).tolist() == \
                    list(range(20, 60))
        assert delivered(live(root, config)) == formed
    assert failed_at == {"tar", "rows", "step"}, failed_at


def test_a_put_read_in_place_checks_as_protobuf_reads_it():
    """`PutRequest.parse` (the server's reader: payload as views of the received bytes) gives the samples
    protobuf's own parse gives, field for field; malformed bytes are refused, never half read."""
    from packfeed.server.live.put_request import PutRequest
    from packfeed.v1.wire_format import WireFormatError

    tokens = [1, 2] + [CONTEXT] * 16 + list(range(20, 40))
    request = pb.PutSamplesRequest(job="j", end=True, samples=[
        message("a", 12, version=-3, group="grp"), message("b", len(tokens), tokens=tokens, images=[png(112, 112)]),
        message("c", 8, tensors={"adv": np.ones(8), "logp": np.zeros(8)}), pb.LiveSample(id="bare"),
        message("d", 6, version=9)], producer="rollout-3")
    request.samples[0].prompt = "prompt-a"
    partial = request.samples[4]  # a rollout's part, with per-sample values and each token's version
    partial.unfinished, partial.part = True, 3
    partial.values.update(reward=0.25, length=-1e300)
    partial.token_versions.CopyFrom(tensor([7, 8, 9, 9, 9, 9], np.int64))
    raw = request.SerializeToString()
    read = PutRequest.parse(raw)
    assert (read.job, read.end, read.ByteSize(), len(read.samples)) == ("j", True, len(raw), 5)
    assert read.producer == "rollout-3" and read.samples[4].values == {"reward": 0.25, "length": -1e300}
    for mine, theirs in zip(read.samples, request.samples):
        try:
            expected = checked_sample(theirs, rules())
        except Refused as refused:
            with pytest.raises(Refused) as again:
                checked_sample(mine, rules())
            assert (again.value.field, str(again.value)) == (refused.field, str(refused))
            continue
        got = checked_sample(mine, rules())
        assert LiveRow.spooled(got, 0, "", 0, {}, []) == LiveRow.spooled(expected, 0, "", 0, {}, [])
        assert got.tokens.tolist() == expected.tokens.tolist()
        assert {k: v.tolist() for k, v in got.tensors.items()} == {k: v.tolist() for k, v in expected.tensors.items()}
        assert [bytes(i) for i in got.images] == list(expected.images) and got.digest == expected.digest
        assert (got.unfinished, got.part, got.covers, got.values) == \
            (expected.unfinished, expected.part, expected.covers, expected.values)
        assert (got.versions().tolist(), got.policy_version) == (expected.versions().tolist(), expected.policy_version)
    assert read.samples[0].policy_version == -3 and read.samples[3].loss_mask is None
    for bad in (raw[:-5], raw[:7], b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\x02\xff\xfe"):
        with pytest.raises(WireFormatError):
            PutRequest.parse(bad)


def test_live_bounds_below_one_step_are_refused_at_open_naming_both_numbers():
    """A step that cannot fit in the server's bounds would never form: the job is refused when it opens."""
    from packfeed.server.serve.job_spec import JobError
    from packfeed.server.serve.registry import check_live_bounds

    with pytest.raises(JobError, match=r"holds 8 samples \(step_samples\).*\(5, --live-max-samples\)"):
        check_live_bounds(PlanConfig(dp=1, live=True, step_samples=8), 0, 5)
    with pytest.raises(JobError, match=r"needs at least 0\.016 MiB of spool.*\(0\.010 MiB, --live-spool-max-gb\)"):
        check_live_bounds(PlanConfig(dp=1, live=True, step_samples=8), 10_000, 0)
    check_live_bounds(PlanConfig(dp=1, live=True, step_samples=8), 20_000, 8)  # room for one step: opens
    check_live_bounds(PlanConfig(dp=1, live=True, step_samples=8, step_tokens=100), 0, 5)  # tokens may form it
