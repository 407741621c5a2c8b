"""Trajectories put into a live job (issue [5/6]), without a server process but through every real piece of it:
the put's checks, the spool's tar files, step formation, the planner, the worker's pack builder reading and
decoding the spooled images, and the client's layouts of the pack. A tree of multi-turn trajectories (a
screenshot at turns 0, 2 and 4 of its root, forks at two depths, one of them put later) comes as one pack whose
shared_prefix rows name each fork's parent; the screenshot is stored and decoded once; a trajectory whose media
do not match its placeholders is refused at the put, naming the turn."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("transformers")

from hf_models import family_dataset  # noqa: E402
from packfeed.client.model.shared_prefix import shared, unshared  # noqa: E402
from packfeed.client.stream.producer import Sample  # noqa: E402
from packfeed.media.image_policy import policy_from_dict  # noqa: E402
from packfeed.server.live.samples import Refused, checked_sample  # noqa: E402
from packfeed.server.live.spool import Spool  # noqa: E402
from packfeed.server.live.step_plan import live_fingerprint  # noqa: E402
from packfeed.server.live.steps import LiveSteps  # noqa: E402
from packfeed.v1.options import PlanConfig  # noqa: E402

CONFIG = PlanConfig(dp=1, microbatches=1, live=True, step_samples=64, token_cap=8192, vision_cap=256)


def png(seed: int, size=(56, 56)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A live job over a qwen2_vl family dataset, in process: (its LiveDataset, conventions, placeholders per
    56x56 image, the dataset's source for the worker)."""
    from packfeed.server.serve import step_work, worker_process
    from packfeed.server.serve.datasets import Dataset

    data = family_dataset(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")
    source = step_work.DatasetSource(str(data.index), str(data.tokenizer))
    worker_process.init_worker({str(data.index): source})
    dataset = Dataset.open(str(data.index), source)
    policy = policy_from_dict(json.loads(data.conventions.image_policy.parameters_json))
    return dataset, data.conventions, policy


def new_live(job, tmp_path):
    from packfeed.server.serve.live_source import LiveDataset

    dataset, _, _ = job
    spool = Spool(tmp_path, "trees", json.dumps({"plan": CONFIG.to_dict()}))
    steps = LiveSteps(spool, CONFIG, 0, live_fingerprint(CONFIG, 0, dataset.fingerprint))
    return LiveDataset(dataset, steps)


class Turns:
    """Builds trajectories turn by turn: observations with a screenshot (its placeholders), the policy's actions."""

    def __init__(self, conventions, policy, seed: int = 0):
        self.rng, self.conventions, self.policy = np.random.default_rng(seed), conventions, policy
        markers = {conventions.image_context_id, conventions.image_start_id, conventions.image_end_id}
        self.allowed = np.array([t for t in range(100, conventions.vocab_size) if t not in markers])

    def text(self, n: int) -> np.ndarray:
        return self.rng.choice(self.allowed, n).astype(np.int32)

    def observation(self, images: int, n_images_in_sample: int) -> tuple[np.ndarray, dict]:
        parts = [self.text(3)]
        for _ in range(images):
            count = self.policy.cost(56, 56, n_images_in_sample).llm_tokens
            parts += [np.full(count, self.conventions.image_context_id, np.int32), self.text(2)]
        tokens = np.concatenate(parts)
        return tokens, {"role": "environment", "tokens": len(tokens), "images": images}

    def action(self) -> tuple[np.ndarray, dict]:
        tokens = self.text(int(self.rng.integers(3, 8)))
        return tokens, {"role": "policy", "tokens": len(tokens), "images": 0}


def trajectory(sample_id, turns, images, parent="", fork=0, group="tree", rng=None) -> dict:
    tokens = np.concatenate([t for t, _ in turns])
    mask = np.concatenate([np.full(len(t), int(meta["role"] == "policy"), np.uint8) for t, meta in turns])
    rng = rng or np.random.default_rng(len(tokens))
    return {"id": sample_id, "group": group, "tokens": tokens, "loss_mask": mask, "images": images,
            "turns": [meta for _, meta in turns], "parent": parent, "fork_turn": fork,
            "tensors": {"advantages": rng.normal(size=len(tokens))}}


def a_tree(job):
    """t0: six turns, the same screenshot A at turns 0, 2 and 4; t1 forks from t0 at turn 2 (its own screenshot B at
    turns 2 and 4); t2 from t1 at turn 4 (screenshot C); t3 from t0 at turn 4, put later (screenshot A again)."""
    _, conventions, policy = job
    build = Turns(conventions, policy)
    a, b, c = png(1), png(2), png(3)
    obs0 = build.observation(1, 3)
    head = [obs0, build.action()]
    t0 = head + [build.observation(1, 3), build.action(), build.observation(1, 3), build.action()]
    t1 = t0[:2] + [build.observation(1, 3), build.action(), build.observation(1, 3), build.action()]
    t2 = t1[:4] + [build.observation(1, 3), build.action()]
    t3 = t0[:4] + [build.observation(1, 3), build.action()]
    first = [trajectory("t0", t0, [a, a, a]), trajectory("t1", t1, [b, b], "t0", 2),
             trajectory("t2", t2, [c], "t1", 4)]
    later = [trajectory("t3", t3, [a], "t0", 4)]
    return first, later


def put(live, samples: list[dict], end: bool = False):
    rules = live.rules(CONFIG)
    checked = []
    for value in samples:
        try:
            checked.append(checked_sample(Sample.of(value).to_proto(), rules))
        except Refused as refused:
            checked.append(refused)
    return live.steps.put(checked, end=end, rules=rules)


def built_packs(live, step: int = 0):
    """The step's packs as a worker builds them (real tar reads and image decoding) and the client reads them;
    with the worker's live reader (its decode count)."""
    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.serve import worker_process
    from packfeed.server.serve.live_source import LivePlan
    from packfeed.server.serve.packs import build_pack
    from packfeed.server.serve.wire import encode_pack
    from packfeed.v1 import packfeed_pb2 as pb

    work = live.work(LivePlan(live.steps, CONFIG, 0), step, pb.Seat(rank=0))
    parts = work.reads.parts(worker_process._dataset)
    packs = []
    for microbatch, (members, truncate_to, sources) in enumerate(work.packs):
        pack = build_pack(parts, members, truncate_to, sources, 0, step, 0, microbatch, 0, work.reads.shared_prefixes)
        pack.step_loss_tokens = work.step_loss_tokens
        work.reads.complete(pack)
        packs.append(pack_of(encode_pack(pack, len(work.packs), False)))
    return packs, parts[0][1]


def test_a_tree_put_in_two_puts_comes_as_one_pack_with_its_images_once(job, tmp_path):
    live = new_live(job, tmp_path)
    first, later = a_tree(job)
    assert [outcome for outcome, _ in put(live, first)] == ["accepted"] * 3
    assert [outcome for outcome, _ in put(live, later, end=True)] == ["accepted"]
    tars = sorted((tmp_path).rglob("*.tar"))
    images_in = [sum(name.endswith(".img") for name in tarfile.open(tar).getnames()) for tar in tars]
    assert images_in == [3, 0]  # A, B and C once in the first put's tar (A carried three times), A not again
    packs, reader = built_packs(live)
    (pack,) = [p for p in packs if not p.empty]
    keys = pack.sample_keys
    rows = {keys[k]: (keys[parent], size) for k, (parent, size) in enumerate(pack.shared_prefix.view(-1, 2).tolist())}
    put_by_id = {s["id"]: s for s in first + later}

    def shares(child, turns):
        return sum(t["tokens"] for t in put_by_id[child]["turns"][:turns])

    assert rows["t1"] == ("t0", shares("t1", 2)) and rows["t2"] == ("t1", shares("t2", 4))
    assert rows["t3"] == ("t0", shares("t3", 4)) and rows["t0"][0] == "t0"
    assert reader.decoded == 3  # A (at three turns of t0, inherited by every fork, and t3's own file), B, C
    assert live.steps.rows["t3"].media[0][1] == live.steps.rows["t0"].batch  # t3's file A is t0's, stored once
    # each trajectory whole: its tokens as put, every image of its turns (inherited ones copied from its parents)
    whole = unshared(pack)
    bounds = whole.cu_seqlens.tolist()
    for k, key in enumerate(keys):
        assert np.array_equal(whole.input_ids[bounds[k]:bounds[k + 1]].numpy(), put_by_id[key]["tokens"])
        assert int((whole.image_sample == k).sum()) == sum(t["images"] for t in put_by_id[key]["turns"])
    # the wire carries each image of the tree once, where its own turn is; the tree layout computes each once
    assert int(pack.image_sample.numel()) == 3 + 2 + 1 + 1
    laid = shared(pack)
    assert int(laid.image_sample.numel()) == int(pack.image_sample.numel())
    tokens_alone = sum(len(s["tokens"]) for s in first + later)
    assert int(laid.input_ids.numel()) == tokens_alone - sum(size - 1 for key, (parent, size) in rows.items()
                                                              if parent != key)
    # every batch is released with the step (the first put's stays while t3, which reads A there, is unconsumed)
    live.steps.release(0)
    assert not list(tmp_path.rglob("*.tar"))


def test_a_fork_keeps_its_parents_batch_across_a_restart(job, tmp_path):
    """A server restarted on the spool between two puts: a fork put after it finds its parent, inherits its
    images, and its own copy of a screenshot spooled before is not stored again; after the step, nothing is
    left."""
    live = new_live(job, tmp_path)
    first, later = a_tree(job)
    put(live, first)
    again = new_live(job, tmp_path)
    assert [outcome for outcome, _ in put(again, later, end=True)] == ["accepted"]
    row = again.steps.rows["t3"]
    assert row.inherited and row.media and row.images == ()
    assert {batch for batch, *_ in row.image_refs()} == {again.steps.rows["t0"].batch}
    packs, _ = built_packs(again)
    assert sum(len(p.sample_keys) for p in packs) == 4 and not any(p.skipped for p in packs)
    again.steps.release(0)
    assert not list(tmp_path.rglob("*.tar"))


def test_a_trajectory_whose_media_do_not_match_its_turns_is_refused_naming_the_turn(job, tmp_path):
    live = new_live(job, tmp_path)
    first, _ = a_tree(job)
    wrong_turn = dict(first[0], id="w0", turns=[dict(t) for t in first[0]["turns"]])
    wrong_turn["turns"][1]["images"], wrong_turn["turns"][2]["images"] = 1, 0  # turn 2's image said to be turn 1's
    trained_observation = dict(first[0], id="w1", loss_mask=np.ones(len(first[0]["tokens"]), np.uint8))
    missing_file = dict(first[0], id="w2", images=first[0]["images"][:2])
    uncovered = dict(first[0], id="w3", turns=first[0]["turns"][:-1])
    orphan = dict(first[1], id="w4", parent="nobody")
    other_start = dict(first[1], id="w5", tokens=first[1]["tokens"].copy())
    other_start["tokens"][0] += 1
    outcomes = put(live, [first[0], wrong_turn, trained_observation, missing_file, uncovered, orphan, other_start])
    assert outcomes[0][0] == "accepted"
    reasons = [reason for _, reason in outcomes[1:]]
    assert reasons[0].startswith("turns[1]: turn 1 brings 1 images"), reasons[0]
    assert reasons[1].startswith("turns[0]: a environment turn holds loss tokens"), reasons[1]
    assert reasons[2].startswith("images: its turns from turn 0 on bring 3 images"), reasons[2]
    assert reasons[3].startswith("turns: its turns hold"), reasons[3]
    assert reasons[4].startswith("parent: trajectory 'nobody' is not accepted"), reasons[4]
    assert reasons[5].startswith("parent: its first 2 turns are not those of 't0'"), reasons[5]
    assert all(outcome == "refused" for outcome, _ in outcomes[1:])


def test_a_superseded_part_gives_back_the_batch_whose_image_it_read(job, tmp_path):
    """A rollout put in parts whose image file was spooled before (read where it lies): once its finished part
    supersedes the first and the step is released, every batch is gone (the first part's hold on the image's
    batch went with it)."""
    _, conventions, policy = job
    build = Turns(conventions, policy, seed=4)
    image = png(7)
    tokens, _ = build.observation(1, 1)

    def one(sample_id, ids, **fields):
        mask = np.r_[np.zeros(len(tokens), np.uint8), np.ones(len(ids) - len(tokens), np.uint8)]
        return {"id": sample_id, "group": "", "tokens": ids, "loss_mask": mask, "images": [image],
                "tensors": {"advantages": np.zeros(len(ids))}, **fields}

    live = new_live(job, tmp_path)
    first = np.r_[tokens, build.text(5)]
    assert put(live, [one("x", first)])[0][0] == "accepted"
    started = np.r_[tokens, build.text(4)]
    assert put(live, [one("u", started, unfinished=True)])[0][0] == "accepted"
    assert live.steps.partials.rows["u"].media  # its image is x's, stored once
    assert put(live, [one("u", np.r_[started, build.text(6)], part=1)], end=True)[0][0] == "accepted"
    live.steps.release(0)
    assert not list(tmp_path.rglob("*.tar"))


@pytest.mark.parametrize("failing", [".tar", ".json"])
def test_a_put_whose_batch_fails_to_write_leaves_the_job_media_as_it_was(job, tmp_path, failing):
    """A put reading a screenshot spooled before, whose own batch (its tar, or its rows after the tar) cannot be
    written: nothing of it is kept and the job's media index names no file of it; its retry reads the screenshot
    where it was spooled, a server restarted after it too, and the step releases every batch."""
    from test_live_steps import failing_writes

    from packfeed.server.live.spool import SpoolError

    live = new_live(job, tmp_path)
    first, later = a_tree(job)
    put(live, first)
    media = dict(live.steps.spool.media)
    failed = failing_writes(live.steps, "batches/", failing)
    with pytest.raises(SpoolError):
        put(live, later)
    assert failed and live.steps.spool.media == media and "t3" not in live.steps.rows
    assert [outcome for outcome, _ in put(live, later)] == ["accepted"]
    again = new_live(job, tmp_path)
    assert again.steps.spool.media == live.steps.spool.media
    assert again.steps.rows["t3"].media == live.steps.rows["t3"].media != ()
    put(again, [], end=True)
    packs, _ = built_packs(again)
    assert sum(len(p.sample_keys) for p in packs) == 4 and not any(p.skipped for p in packs)
    again.steps.release(0)
    assert not list(tmp_path.rglob("*.tar"))
