"""Every rank calls every vision tower alike (issue [5/6]): `to_hf_inputs(..., ensure_encoders=True)` gives a
pack without images (or without videos) one dummy item per tower it would not call, so under FSDP or ZeRO-3 with
the tower wrapped apart no rank skips the tower's collectives; the loss and every gradient stay those of the
pack without it (within 1e-6), on real `transformers` models built from tiny configs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import family_dataset, packs_of, tiny_model  # noqa: E402
from packfeed.client.model.hf import empty_hf_inputs, to_hf_inputs  # noqa: E402


def tower_of(model, family: str):
    return model.model.visual if family.startswith("qwen") else model.model.vision_tower


def loss_and_grads(model, inputs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl", "llava"])
def test_ensure_encoders_runs_every_tower_and_changes_no_loss_or_gradient(tmp_path, family):
    data = family_dataset(tmp_path, family)
    model = tiny_model(family, data)
    calls = []
    tower_of(model, family).register_forward_hook(lambda *_: calls.append(1))
    text_only, with_images = packs_of(data, [[0, 4], [1, 2]])  # samples 0 and 4 hold no image
    towers = 2 if family.startswith("qwen") and data.conventions.HasField("video_context_id") else 1
    for pack, own_calls in ((text_only, 0), (with_images, 1)):
        calls.clear()
        plain = to_hf_inputs(pack, family, conventions=data.conventions)
        loss, grads = loss_and_grads(model, plain)
        assert len(calls) == own_calls
        calls.clear()
        ensured = to_hf_inputs(pack, family, conventions=data.conventions, ensure_encoders=True)
        ensured_loss, ensured_grads = loss_and_grads(model, ensured)
        assert len(calls) == towers  # every tower once, whatever the pack holds
        assert ensured["input_ids"].shape[1] > plain["input_ids"].shape[1] or own_calls == towers
        assert ensured_loss == pytest.approx(loss, rel=1e-6, abs=1e-7)
        for name, grad in ensured_grads.items():
            expected = grads.get(name, torch.zeros_like(grad))  # the tower's: zeros from the dummy alone
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7, msg=name)
    calls.clear()
    empty = empty_hf_inputs(text_only, model_family=family, conventions=data.conventions)
    assert float(model(**empty).loss.nan_to_num(0.0)) == 0.0 and len(calls) == towers
    with pytest.raises(ValueError, match="conventions"):
        to_hf_inputs(text_only, family, ensure_encoders=True)


def run_bounded(worker, args: tuple, world: int, timeout: float) -> bool:
    """Spawn `world` processes of `worker`; True when all finished, False when they crashed or were still
    running after `timeout` seconds (then killed): the test never hangs itself."""
    import time

    from spawned import spawn

    context = spawn(worker, args=(world, *args), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if context.join(timeout=1):
                return True
        return False
    except Exception:  # a rank died (gloo refuses collectives that do not match)
        return False
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def plan_steps(data, world: int, collective_safe: bool) -> list[list[list[int]]]:
    """Every step of a DP `world`, M 1 plan of the dataset (about one sample a pack): its packs' sample ids."""
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan
    from packfeed.v1.options import PlanConfig

    loads, _ = load_sample_loads(data.index)
    plan = make_plan(loads, PlanConfig(dp=world, samples_per_pack=2.0, collective_safe=collective_safe), 0, 0)
    return [[plan.pack(step, rank, 0).tolist() for rank in range(world)] for step in range(plan.n_steps)]


MOSTLY_TEXT = (5,) * 12 + (0, 1, 6)  # video_data.mixed_samples' kinds: 80% text only; an image, an mp4, both


@pytest.fixture(scope="module")
def mostly_text(tmp_path_factory):
    pytest.importorskip("av")
    from test_hf_video import video_family

    # 8 of each kind of sample with media: DP 2 and DP 4 align them all
    return video_family(tmp_path_factory.mktemp("mostly-text"), "qwen2_vl", samples=120, kinds=MOSTLY_TEXT)


@pytest.mark.parametrize("world", [2, 4])
def test_an_fsdp2_loop_with_the_tower_wrapped_apart_never_hangs_on_a_collective_safe_plan(tmp_path, world,
                                                                                         mostly_text):
    """A user's FSDP2 loop, each vision block a unit of its own, on a mostly-text dataset (80% text only; the
    rest images, videos, and samples with both, which call Qwen2-VL's tower twice) planned for DP `world`. A step
    of the plan made with --no-collective-safe where ranks' packs call the tower differently never completes
    (the control, bounded); the default plan's steps hold images on every rank or on none, and videos likewise,
    and its step where every rank runs the tower completes without any guard, with the plain loop's loss; the
    unaligned step completes too once `ensure_encoders` runs every tower."""
    from trainer_workers import sharded_tower_step

    family, data = "qwen2_vl", mostly_text
    from packfeed.server.index.table import read_index

    table = read_index(data.index)[0]
    media = {sample: (images, videos) for sample, images, videos in
             zip(*(table.column(c).to_pylist() for c in ("sample_id", "n_images", "n_videos")))}
    assert sum(1 for images, videos in media.values() if not images and not videos) == 96  # 80% of the 120
    assert sum(1 for _, videos in media.values() if videos) == 16 and sum(1 for images, _ in media.values() if images) == 16

    def towers(group: list[int]) -> tuple[bool, bool]:  # does the pack call the tower on images, on videos
        return any(media[i][0] for i in group), any(media[i][1] for i in group)

    safe = plan_steps(data, world, True)
    for groups in safe:
        assert len({towers(g) for g in groups}) == 1, groups  # every rank alike
    assert any(towers(groups[0])[1] for groups in safe)  # videos are planned in too
    with_encoders = max(safe, key=lambda groups: sum(towers(groups[0])))  # every rank runs the tower
    assert any(towers(with_encoders[0]))
    # the control: ranks that call the tower a different number of times (an image on one rank and a video on
    # another each call it once, which FSDP's collectives do not tell apart)
    mixed = next(groups for groups in plan_steps(data, world, False) if len({sum(towers(g)) for g in groups}) > 1)

    def run(groups, ensure: bool, name: str) -> bool:
        packs = packs_of(data, groups)
        torch.save({"data": data, "packs": packs}, tmp_path / f"{name}.pt")
        (tmp_path / name).mkdir()
        args = (family, str(tmp_path / f"{name}.pt"), str(tmp_path / f"init-{name}"), str(tmp_path / name), ensure)
        done = run_bounded(sharded_tower_step, args, world, timeout=30 if name == "control" else 300)
        if done:
            sharded = sum(torch.load(tmp_path / name / f"rank{r}.pt")["loss"] for r in range(world))
            model = tiny_model(family, data)
            with torch.no_grad():
                plain = sum(float(model(**to_hf_inputs(pack, family, dp=world, conventions=data.conventions)).loss)
                            for pack in packs)
            assert sharded == pytest.approx(plain, rel=1e-5)
        return done

    assert not run(mixed, False, "control")
    assert not list((tmp_path / "control").glob("rank*.pt"))
    assert run(with_encoders, False, "safe")
    assert run(mixed, True, "ensured")


def trained_towers(data, server, tmp_path, name: str, **options) -> tuple[dict, list[int], list[float]]:
    """A PackfeedTrainer (one process, AdamW with weight decay) over the whole job: its vision tower's weights
    at the end, each step's real visual items, the losses."""
    import transformers

    from packfeed.client import PackStream, PlanConfig
    from packfeed.client.model.guard_updates import tower_parameters, visual_items
    from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, packfeed_training_arguments

    items, losses = [], []

    class Seen(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            items.append(visual_items(trainer.packfeed_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            losses.extend([logs["loss"]] if "loss" in logs else [])

    plan = PlanConfig(dp=1, microbatches=1, token_cap=300, vision_cap=16)  # 5 steps: 3 with images, then 2 without
    with PackStream(server.target, job=name, rank=0, plan=plan, seed=0) as stream:
        args = packfeed_training_arguments(stream, output_dir=str(tmp_path / name), report_to=[], use_cpu=True,
                                           logging_steps=1, learning_rate=1e-2, weight_decay=0.1,
                                           save_strategy="no", disable_tqdm=True)
        torch.manual_seed(0)
        model = tiny_model("internvl", data).train()
        trainer = PackfeedTrainer(model=model, args=args, stream=stream, family="internvl",
                                  callbacks=[Seen()], **options)
        trainer.train()
    return ({id_: p.detach().clone() for id_, p in enumerate(tower_parameters(model))}, items, losses)


def test_a_step_only_the_guard_ran_through_the_tower_leaves_it_as_an_unguarded_run_does(tmp_path):
    """`ensure_encoders` gives a text-only step's tower zero gradients, and AdamW would still move it (momentum,
    weight decay). PackfeedTrainer drops them when no rank's step held an image (`skip_guard_updates`, on by
    default): the tower ends as in a run without the guard; with it off, it does not."""
    from packfeed.client import LocalServer

    data = family_dataset(tmp_path / "data", "internvl", samples=24, image_counts=(1, 0, 0, 0, 0, 0))
    with LocalServer(data.index, workers=1) as server:
        plain, items, plain_losses = trained_towers(data, server, tmp_path, "plain", ensure_encoders=False)
        guarded, guarded_items, guarded_losses = trained_towers(data, server, tmp_path, "guarded",
                                                                ensure_encoders=True)
        moved, _, _ = trained_towers(data, server, tmp_path, "moved", ensure_encoders=True,
                                     skip_guard_updates=False)
    assert guarded_items == items
    assert any(a > 0 and b == 0 for a, b in zip(items, items[1:])), items  # a text-only step after an image step
    assert guarded_losses == pytest.approx(plain_losses, rel=1e-5)
    assert all(torch.allclose(guarded[k], plain[k], rtol=1e-5, atol=1e-7) for k in plain)
    assert max(float((moved[k] - plain[k]).abs().max()) for k in plain) > 1e-4
