"""A job's length is what it streams: epochs plan different step counts (each shuffles its samples into other
packs and aligns them anew), so the job's steps are every epoch's own count, summed, and `JobInfo`,
`len(PackStream)`, the Hugging Face Trainer face and the status report use that sum. Real `packfeed serve`, real
gRPC, a tiny real `transformers` model."""

from __future__ import annotations

import json
import urllib.request

import pytest

from ports import free_port
from packfeed.client import LocalServer, PackStream, PlanConfig

pytestmark = pytest.mark.slow
# A mostly-text recipe: 80 samples, 16 with images (8 with two, 8 with one); at DP 2, M 2, seed 1 its three
# epochs plan 2, 3 and 2 steps (found by planning, checked below against the server)
PLAN = PlanConfig(dp=2, microbatches=2, token_cap=600, vision_cap=16)
ONE_RANK = PlanConfig(dp=1, microbatches=4, token_cap=600, vision_cap=16)  # 2, 3, 2 as well: one Trainer process
SEED, EPOCHS = 1, 3


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    from hf_models import family_dataset

    return family_dataset(tmp_path_factory.mktemp("mostly-text"), "internvl", samples=80,
                          image_counts=(2, 0, 0, 0, 0, 1, 0, 0, 0, 0))


@pytest.fixture(scope="module")
def server(recipe):
    port = free_port()
    with LocalServer(recipe.index, workers=1, metrics_port=port) as running:
        running.metrics_port = port
        yield running


def epoch_counts(index, plan: PlanConfig = PLAN) -> list[int]:
    """Each epoch's steps as the planner plans them, epoch by epoch."""
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.caps import resolve_caps
    from packfeed.server.plan.planner import make_plan

    loads, _ = load_sample_loads(index)
    caps = resolve_caps(loads, plan)
    return [make_plan(loads, plan, SEED, epoch, caps=caps).n_steps for epoch in range(EPOCHS)]


def test_the_job_announces_and_streams_every_epochs_own_steps(server, recipe):
    counts = epoch_counts(recipe.index)
    assert len(set(counts)) > 1, f"the recipe no longer plans epochs of different lengths: {counts}"
    with PackStream(server.target, job="length", rank=0, plan=PLAN, seed=SEED, epochs=EPOCHS) as stream:
        # a loaded server may still be counting later epochs at open (count_at_open_s): len() waits for them
        assert len(stream) == sum(counts)  # not epoch 0's count times the epochs
        info = stream.info
        assert list(info.epoch_steps) == counts and info.steps == sum(counts) and not info.steps_estimated
        steps = [(step.epoch, step.step) for step in stream]
        assert [stream.step_number(*position) for position in steps] == list(range(len(stream)))
        stream.close_job()  # training over: the job ends on the server
    assert len(steps) == sum(counts)
    assert [sum(1 for epoch, _ in steps if epoch == e) for e in range(EPOCHS)] == counts
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/status.json",
                                               timeout=10).read())
    assert "length" in [job["job"] for job in status["closed_jobs"]]
    assert "length" not in [job["job"] for job in status["jobs"]]


def test_the_trainer_face_stops_at_the_last_step_with_its_schedule_at_zero(server, recipe, tmp_path):
    import transformers

    from hf_models import tiny_sizes
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, packfeed_training_arguments
    from packfeed.trainer.models.hf.build import build_hf_model

    class Seen(transformers.TrainerCallback):
        def __init__(self):
            self.rates, self.logs = [], []

        def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
            self.rates.append(lr_scheduler.get_last_lr()[0])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.logs.append(logs)

    seen = Seen()
    counts = epoch_counts(recipe.index, ONE_RANK)
    assert len(set(counts)) > 1, f"the recipe no longer plans epochs of different lengths: {counts}"
    with PackStream(server.target, job="trainer", rank=0, plan=ONE_RANK, seed=SEED, epochs=EPOCHS) as stream:
        args = packfeed_training_arguments(stream, output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                           logging_steps=1, learning_rate=1e-3, lr_scheduler_type="linear",
                                           save_strategy="no")
        assert args.max_steps == len(stream) == sum(counts)
        model = build_hf_model("internvl", stream.conventions, tiny_sizes("internvl"))
        trainer = PackfeedTrainer(model=model, args=args, stream=stream, family="internvl", callbacks=[seen])
        trainer.train()
        total = len(stream)
    assert trainer.state.global_step == total == len(seen.rates)
    assert seen.rates[-1] == 0.0 and all(rate > 0 for rate in seen.rates[:-1])  # the schedule ends at the end
    assert [log["packfeed_step"] for log in seen.logs] == list(range(1, total + 1))
    assert {log["packfeed_steps"] for log in seen.logs} == {total}


def test_the_status_report_counts_every_epochs_steps(server, recipe):
    counts = epoch_counts(recipe.index)
    with PackStream(server.target, job="status", rank=0, plan=PLAN, seed=SEED, epochs=EPOCHS) as stream:
        for _ in stream:
            pass
    status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/status.json",
                                               timeout=10).read())
    (job,) = [job for job in status["jobs"] if job["job"] == "status"]
    assert job["plan"]["epoch_steps"] == counts and job["plan"]["steps"] == sum(counts)
    assert job["ranks"][0]["done_steps"] == sum(counts)
    assert job["state"] != "finished"  # rank 1 never read: the job is not done


def test_a_job_whose_epochs_are_counted_in_the_background_opens_and_its_length_waits_for_them(recipe):
    """`count_at_open_s` 0: the open counts epoch 0 alone and the rest in the background (an open of 1,000
    epochs would otherwise plan them all first); `len(stream)` asks again until the count is exact, and the
    status report ends with every epoch's own count."""
    counts = epoch_counts(recipe.index)
    assert len(set(counts)) > 1  # an estimate from epoch 0 alone would be wrong
    with LocalServer(recipe.index, workers=1, env={"PACKFEED_COUNT_AT_OPEN_S": "0"}) as server:
        with PackStream(server.target, job="counted-later", rank=0, plan=PLAN, seed=SEED, epochs=EPOCHS) as stream:
            assert len(stream) == sum(counts)
            assert list(stream.info.epoch_steps) == counts and not stream.info.steps_estimated
