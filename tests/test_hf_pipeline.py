"""`transformers` VLMs of every family cut into pipeline stages (real torch.distributed, gloo on CPU): the
first step's loss and every parameter's gradient equal the unmodified model's forward and backward on the same
packs, within 1e-5 in fp32; a control that breaks the hand-off between stages differs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from spawned import spawn  # noqa: E402

from hf_models import family_dataset, packs_of, tiny_model  # noqa: E402
from packfeed.client.model.hf import register_varlen_attention, to_hf_inputs  # noqa: E402
from trainer_workers import hf_pipeline_step  # noqa: E402

pytestmark = pytest.mark.slow
GROUPS = [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]  # one global step: text-only, one- and two-image samples


def reference(data, family: str, packs) -> tuple[float, dict[str, torch.Tensor]]:
    """The unmodified model's loss and gradients over the whole global step, one pack at a time."""
    model = tiny_model(family, data, register_varlen_attention(), deep=True)
    total = 0.0
    for pack in packs:
        loss = model(**to_hf_inputs(pack, family, dp=1, attention="varlen")).loss
        loss.backward()
        total += float(loss.detach())
    return total, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def run(tmp_path, family: str, data, packs, dp: int, pp: int, bounds: list[int], **options) -> list[dict]:
    torch.save({"data": data, "packs": packs}, tmp_path / "step.pt")
    world = dp * pp
    spawn(hf_pipeline_step, args=(world, dp, pp, family, str(tmp_path / "step.pt"), str(tmp_path / "init"),
                                  str(tmp_path), bounds, options.get("schedule", "1f1b"),
                                  options.get("virtual", 1), options.get("break_positions", False),
                                  options.get("data_parallel", "ddp"), options.get("encoder", "stages")),
          nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def gathered(results, dp: int, pp: int) -> tuple[float, list[dict[str, torch.Tensor]]]:
    loss = sum(sum(r["losses"]) for r in results)
    replicas = []
    for replica in range(dp):
        grads: dict[str, torch.Tensor] = {}
        for stage in range(pp):
            for name, grad in results[replica * pp + stage]["grads"].items():
                if name in grads:  # a tied weight: every holder has the summed gradient
                    torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
                grads[name] = grad
        replicas.append(grads)
    return loss, replicas


def assert_same_step(results, dp: int, pp: int, expected_loss: float, expected: dict[str, torch.Tensor]) -> None:
    loss, replicas = gathered(results, dp, pp)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    for grads in replicas:
        assert set(expected) <= set(grads), f"gradients missing: {sorted(set(expected) - set(grads))}"
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
        for name in set(grads) - set(expected):  # run only on padding (e.g. a vision tower on text-only packs)
            assert float(grads[name].abs().max()) == 0.0, name


# family -> a 2-stage partition whose boundary carries what matters: vision carriers (Qwen's patch positions,
# window order, DeepStack features), or the text carrier with a weight tied across stages (InternVL)
TWO_STAGES = {"internvl": [0, 5, 8], "qwen2_vl": [0, 2, 8], "qwen2_5_vl": [0, 3, 9], "qwen3_vl": [0, 2, 9],
              "llava": [0, 3, 8]}


@pytest.mark.parametrize("family", sorted(TWO_STAGES))
def test_two_stages_give_the_models_own_loss_and_gradients(tmp_path, family):
    data = family_dataset(tmp_path / "data", family)
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, family, packs)
    results = run(tmp_path, family, data, packs, dp=1, pp=2, bounds=TWO_STAGES[family])
    assert_same_step(results, 1, 2, expected_loss, expected)


def test_four_stages_carry_deepstack_features_across_three_boundaries(tmp_path):
    data = family_dataset(tmp_path / "data", "qwen3_vl")
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, "qwen3_vl", packs)
    results = run(tmp_path, "qwen3_vl", data, packs, dp=1, pp=4, bounds=[0, 2, 4, 6, 9])
    assert_same_step(results, 1, 4, expected_loss, expected)


def test_interleaved_1f1b_with_the_embedding_tied_across_ranks(tmp_path):
    """2 ranks x 2 virtual stages: rank 0 runs stages 0 and 2 (the embedding), rank 1 stages 1 and 3 (the head
    whose weight is the embedding's)."""
    data = family_dataset(tmp_path / "data", "internvl")
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, "internvl", packs)
    results = run(tmp_path, "internvl", data, packs, dp=1, pp=2, bounds=[0, 2, 4, 6, 8],
                  schedule="interleaved_1f1b", virtual=2)
    assert_same_step(results, 1, 2, expected_loss, expected)


def test_data_parallel_pipelines_give_the_global_steps_gradients(tmp_path):
    """DP 2 x PP 2: each replica trains 2 of the 4 packs; DDP averages, the loss normaliser undoes it."""
    data = family_dataset(tmp_path / "data", "qwen2_5_vl")
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, "qwen2_5_vl", packs)
    results = run(tmp_path, "qwen2_5_vl", data, packs, dp=2, pp=2, bounds=[0, 3, 9])
    assert_same_step(results, 2, 2, expected_loss, expected)


def test_fsdp2_within_each_stage_with_the_embedding_tied_across_stages(tmp_path):
    """DP 2 x PP 2 with FSDP2 over each stage's replicas (blocks and stage sharded): InternVL's embedding on stage
    0 and its tied head on stage 1 sum their gradient shards, which equal the model's."""
    data = family_dataset(tmp_path / "data", "internvl")
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, "internvl", packs)
    results = run(tmp_path, "internvl", data, packs, dp=2, pp=2, bounds=TWO_STAGES["internvl"], data_parallel="fsdp")
    assert_same_step(results, 2, 2, expected_loss, expected)


def test_a_broken_hand_off_is_caught(tmp_path):
    """The control: the second stage receives zeroed positions (M-RoPE rows and the text row) — the loss and
    gradients no longer match, so the equality above can fail."""
    data = family_dataset(tmp_path / "data", "qwen2_vl")
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, "qwen2_vl", packs)
    results = run(tmp_path, "qwen2_vl", data, packs, dp=1, pp=2, bounds=[0, 6, 8], break_positions=True)
    with pytest.raises(AssertionError):
        assert_same_step(results, 1, 2, expected_loss, expected)


def sequential_step(model, batch, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Every microbatch through the whole layer list in one process: the summed loss and the gradients."""
    total = 0.0
    for k in range(m):
        carrier = batch.microbatch(k, m)
        for layer in model.layers:
            carrier = layer(*carrier)
        loss = carrier[0].sum() / batch.shape.step_loss_tokens
        loss.backward()
        total += float(loss.detach())
    grads = {names[local]: p.grad.clone() for layer, names in zip(model.layers, model.parameter_names)
             for local, p in layer.named_parameters(remove_duplicate=False) if p.grad is not None}
    model.hf.zero_grad(set_to_none=True)
    return total, grads


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl"])
def test_a_padded_batch_gives_the_packs_loss_and_gradients_at_more_tokens(tmp_path, family):
    """`data.collate=padded` (the benchmarks' baseline): every sample padded to its pack's longest, positions,
    labels and image places moved with it; the loss and gradients stay the pack's, the tokens grow."""
    from packfeed.client.stream.tensors import Step
    from packfeed.trainer.models.hf.model import HFLayerModel

    data = family_dataset(tmp_path / "data", family)
    packs = packs_of(data, GROUPS)
    model = HFLayerModel(family, data.conventions,
                         model=tiny_model(family, data, register_varlen_attention(), deep=True))
    packed = model.inputs(Step(0, 0, 0, packs), 64, 1)
    padded = model.inputs(Step(0, 0, 0, packs), 64, 1, collate="padded")
    from packfeed.trainer.models.hf.inputs import padded_batch

    rows = [model.builder.pack(p, 1) for p in packs]
    assert sum(padded_batch(r).input_ids.numel() for r in rows) > sum(r.input_ids.numel() for r in rows)
    assert padded.shape.tokens >= packed.shape.tokens
    loss, grads = sequential_step(model, packed, len(packs))
    padded_loss, padded_grads = sequential_step(model, padded, len(packs))
    assert padded_loss == pytest.approx(loss, rel=1e-5)
    assert grads.keys() == padded_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("family, dp, pp", [("internvl", 1, 2), ("llava", 2, 2)])
def test_the_vision_tower_in_the_bubbles_gives_the_models_own_loss_and_gradients(tmp_path, family, dp, pp):
    """parallel.encoder=bubbles on a `transformers` tile family: the vision tower on every rank, encoding its
    share of each microbatch's tiles in the schedule's idle time; the same loss and gradients as the model."""
    data = family_dataset(tmp_path / "data", family)
    packs = packs_of(data, GROUPS)
    expected_loss, expected = reference(data, family, packs)
    from packfeed.trainer.models.hf.model import HFLayerModel

    layered = HFLayerModel(family, data.conventions,
                           model=tiny_model(family, data, register_varlen_attention(), deep=True))
    first, n = layered.vision.encoder_layers, layered.n_layers
    results = run(tmp_path, family, data, packs, dp=dp, pp=pp, bounds=[first, (first + n) // 2, n], encoder="bubbles")
    assert_same_step(results, dp, pp, expected_loss, expected)
    assert all(len(r["grads"]) > 0 for r in results)


def test_a_qwen_vision_tower_is_refused_for_the_bubbles(tmp_path):
    """Qwen towers attend across an image's patches under per-image geometry: their work does not divide by tile,
    and parallel.encoder=bubbles says so at start."""
    from packfeed.trainer.models.hf.model import HFLayerModel
    from packfeed.trainer.parallel.pipeline import separate_encoder_layers

    data = family_dataset(tmp_path / "data", "qwen2_vl")
    model = HFLayerModel("qwen2_vl", data.conventions, model=tiny_model("qwen2_vl", data))
    assert model.vision is None
    with pytest.raises(ValueError, match="parallel.encoder=stages"):
        separate_encoder_layers(model, "bubbles")
