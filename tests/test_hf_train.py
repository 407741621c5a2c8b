"""Hugging Face models trained on packs across processes: FSDP2 at DP 2 gives the gradients of one process
training on the whole global step; `packfeed train model.hf=FAMILY` trains under torchrun and resumes from a
checkpoint at exactly the next step."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from spawned import spawn  # noqa: E402

from doc_commands import quoted_train  # noqa: E402
from hf_models import family_dataset, packs_of, tiny_model  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402
from trainer_workers import fsdp_output_views, hf_step_grads, packfeed_train, restart_from  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family,wrap", [("qwen2_vl", "fsdp"), ("internvl", "fsdp"), ("llava", "ddp")])
def test_dp_2_matches_one_process_on_the_global_step(tmp_path, family, wrap):
    """FSDP2 (what `packfeed train model.hf` uses) or DDP at DP 2: both average gradients over the ranks, and
    with num_items_in_batch = step tokens / dp they equal one process training on the whole global step."""
    data = family_dataset(tmp_path / "data", family)
    packs = packs_of(data, [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]])  # one global step: 2 ranks x 2 microbatches
    torch.save({"data": data, "packs": packs}, tmp_path / "step.pt")
    spawn(hf_step_grads, args=(2, family, str(tmp_path / "step.pt"), str(tmp_path / "init"), str(tmp_path), wrap),
          nprocs=2, join=True)

    model = tiny_model(family, data)
    reference_loss = 0.0
    for pack in packs:
        loss = model(**to_hf_inputs(pack, family, dp=1)).loss
        loss.backward()
        reference_loss += float(loss.detach())
    reference = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sum(r["loss"] for r in ranks) / 2 == pytest.approx(reference_loss, rel=1e-5)
    for rank in ranks:
        assert rank["grads"].keys() == reference.keys()
        for name, grad in reference.items():
            torch.testing.assert_close(rank["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packfeed_train_trains_a_hf_model_and_resumes_exactly(tmp_path):
    """docs/training.md's FSDP2 command (pp=1, DP 2), for 6 steps of a tiny model on a small dataset."""
    nproc, quoted = quoted_train("tests/test_hf_train.py")
    assert nproc == 2 and {"model.hf=qwen2_vl", "parallel.pp=1", "parallel.dp=2"} <= set(quoted)
    data = family_dataset(tmp_path / "data", "qwen2_vl", samples=60)
    common = quoted + [f"data.index={data.index}", "data.microbatches=2", "data.epochs=3", "checkpoint.every=2",
                       "optim.warmup_steps=1", "model.hf_config={text: {hidden_size: 32, num_hidden_layers: 2}}"]
    _, straight = packfeed_train(nproc, common + ["optim.steps=6"], tmp_path / "straight")
    restart_from(tmp_path / "straight", tmp_path / "resumed", 4)  # as if stopped after its checkpoint at step 4
    log, rest = packfeed_train(nproc, common + ["optim.steps=6"], tmp_path / "resumed")
    assert "resuming from" in log and "after 4 steps" in log
    assert len(straight) == 6 and len(rest) == 6  # metrics.jsonl is appended: 4 lines, then 2 more
    assert [(r["epoch"], r["step"]) for r in rest] == [(r["epoch"], r["step"]) for r in straight]
    assert [r["loss"] for r in rest] == pytest.approx([r["loss"] for r in straight], rel=1e-6)
    assert straight[-1]["loss"] < straight[0]["loss"]  # it learns
    assert all(r["tokens"] > 0 and r["samples_by_dataset"] for r in straight)


def test_padded_batches_train_as_the_packs_do(tmp_path):
    """`data.collate=padded` at pp=1: HF's usual padded batches of the same samples give the same losses, and
    their padding is counted; every step's loss is finite, the last step's empty microbatch included."""
    data = family_dataset(tmp_path / "data", "qwen2_vl", samples=22)  # random packs of 4: 6 packs, 2 steps of M 4
    common = ["model.hf=qwen2_vl", f"data.index={data.index}", "parallel.pp=1", "data.microbatches=4",
              "data.strategy=random",
              "data.epochs=1", "optim.warmup_steps=1", "model.hf_config={text: {hidden_size: 32, num_hidden_layers: 2}}"]
    _, packed = packfeed_train(1, common, tmp_path / "packed")
    _, padded = packfeed_train(1, common + ["data.collate=padded"], tmp_path / "padded")
    assert [r["tokens"] for r in padded] == [r["tokens"] for r in packed]
    assert [r["loss"] for r in padded] == pytest.approx([r["loss"] for r in packed], rel=1e-4)
    assert all(r["padded_tokens"] == r["tokens"] for r in packed)
    for record in packed + padded:  # rank 0's M packs, as the reference model's records give them
        assert len(record["microbatches"]) == 4
    assert [sum(m["tokens"] for m in r["microbatches"]) for r in padded] == [r["padded_tokens"] for r in padded]
    assert [sum(m["tokens"] for m in r["microbatches"]) for r in packed] == [r["tokens"] for r in packed]
    assert sum(r["padded_tokens"] for r in padded) > sum(r["tokens"] for r in padded)
    assert len(packed) == 2 and all(math.isfinite(r["loss"]) for r in packed + padded)


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl"])
def test_the_views_fsdp2_warns_about_are_the_per_image_features_alone(tmp_path, family):
    """FSDP2 warns that the wrapped model "returned a view tensor": an in-place op on it would drop its
    pre-backward hook. The views are the per-image features in `image_outputs` (a split of the merged
    features); the loss and logits are not views, the loop reads only `.loss` and writes no output in place, and
    the DP 2 gradients above equal one process's: harmless."""
    data = family_dataset(tmp_path / "data", family)
    torch.save({"data": data, "packs": packs_of(data, [[1, 2]])}, tmp_path / "step.pt")
    spawn(fsdp_output_views, args=(1, family, str(tmp_path / "step.pt"), str(tmp_path / "init"), str(tmp_path)),
          nprocs=1, join=True)
    views = torch.load(tmp_path / "rank0.pt")["views"]
    assert views == ["image_outputs"]
