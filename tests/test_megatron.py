"""Megatron-Core fed by Packfeed (`packfeed.client.megatron`), on CPU against Megatron-Core's own code: its THD
batch utility takes our batches and gives back our `PackedSeqParams`; the loss over a batch's labels and loss
mask is exactly the Hugging Face shifted loss of the pack (whatever the padding); the loss normalisation
matches the step's per-token mean in both of Megatron's modes; a stream's steps resume exactly. (Megatron's
pipeline schedules allocate on CUDA: they run only where a GPU is lent.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from hf_models import family_dataset, packs_of  # noqa: E402
from packfeed.client.hf import to_hf_inputs  # noqa: E402
from packfeed.client.megatron import MegatronSteps, loss_func, megatron_batch, packed_seq_params  # noqa: E402


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    data = family_dataset(tmp_path_factory.mktemp("megatron"), "qwen2_vl")
    return data, packs_of(data, [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]])


def hf_loss_sum(pack, logits: torch.Tensor, conventions) -> torch.Tensor:
    """What transformers computes for the pack: labels shifted inside the loss, summed."""
    labels = to_hf_inputs(pack, "qwen2_vl", conventions=conventions)["labels"][0]
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("pad", [1, 4])
def test_a_megatron_batch_gives_the_hf_loss_and_megatrons_own_thd_split_takes_it(packs, pad):
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    data, served = packs
    for pack in served:
        batch = megatron_batch(pack, pad_to_multiple=pad)
        real, padded = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        assert real == pack.cu_seqlens.tolist() and all(b % pad == 0 for b in padded)
        assert int(batch["loss_mask"].sum()) == pack.loss_tokens
        logits = torch.randn(pack.input_ids.shape[0], data.vocab, generator=torch.Generator().manual_seed(0))
        placed = torch.zeros(batch["tokens"].shape[1], data.vocab)  # the same logits at their padded offsets
        for (a, b), start in zip(zip(real[:-1], real[1:]), padded[:-1]):
            placed[start:start + b - a] = logits[a:b]
            assert torch.equal(batch["tokens"][0, start:start + b - a], pack.input_ids[a:b].long())
        per_token = torch.nn.functional.cross_entropy(placed, batch["labels"][0], reduction="none")
        summed, tokens, _ = loss_func(batch, per_token)
        torch.testing.assert_close(summed, hf_loss_sum(pack, logits, data.conventions), rtol=1e-6, atol=1e-5)
        assert int(tokens) == pack.loss_tokens
        split, params = get_thd_batch_on_this_cp_rank(dict(batch), batch["cu_seqlens"], batch["cu_seqlens_padded"],
                                                      batch["max_seqlen"], cp_size=1, cp_rank=0)
        ours = packed_seq_params(batch)
        assert params.qkv_format == ours.qkv_format == "thd" and params.max_seqlen_q == ours.max_seqlen_q
        assert torch.equal(params.cu_seqlens_q, ours.cu_seqlens_q)
        assert torch.equal(params.cu_seqlens_kv_padded, ours.cu_seqlens_kv_padded)
        assert torch.equal(split["tokens"], batch["tokens"])


def test_both_of_megatrons_normalisations_give_the_steps_per_token_mean(packs):
    _, served = packs
    step_tokens = served[0].step_loss_tokens
    sums, scaled = [], []
    for pack in served:
        batch = megatron_batch(pack)
        per_token = torch.rand(batch["tokens"].shape[1], generator=torch.Generator().manual_seed(pack.microbatch))
        total, tokens, _ = loss_func(batch, per_token)
        sums.append(float(total))
        loss, _ = loss_func(batch, per_token, per_token=False, num_microbatches=len(served), dp=1)
        scaled.append(float(loss) / len(served))  # Megatron divides each microbatch's loss by their number
    mean = sum(sums) / step_tokens
    assert sum(scaled) == pytest.approx(mean, rel=1e-6)  # calculate_per_token_loss=False
    assert sum(sums) / sum(int(megatron_batch(p)["loss_mask"].sum()) for p in served) == pytest.approx(mean)


def test_megatron_steps_over_a_stream_resume_at_exactly_the_next_step(small_tile_index):
    from packfeed.client import LocalServer, PackStream

    plan = dict(dp=1, microbatches=2, seed=0)
    with LocalServer(small_tile_index, workers=1) as server:
        steps = MegatronSteps(PackStream(server.target, job="mcore", rank=0, **plan), pad_to_multiple=2)
        first = next(steps)
        state = steps.state_dict()
        following = next(steps)
        steps.stream.close()
        again = MegatronSteps(PackStream(server.target, job="mcore", rank=0, **plan), pad_to_multiple=2)
        again.load_state_dict(state)
        resumed = next(again)
        again.stream.close()
    assert first.num_microbatches == 2 and first.seq_length >= max(b["tokens"].shape[1] for b in first.batches)
    assert (resumed.epoch, resumed.step) == (following.epoch, following.step) != (first.epoch, first.step)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(resumed.batches, following.batches))
    assert len(list(first.data_iterator)) == 2 and "images" in first.batches[0]
