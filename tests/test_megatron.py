"""Megatron-Core fed by Packfeed (`packfeed.client.frameworks.megatron`), on CPU against Megatron-Core's own code: its THD
batch utility takes our batches and gives back our `PackedSeqParams`; the loss over a batch's labels and loss
mask is exactly the Hugging Face shifted loss of the pack (whatever the padding); the loss normalisation
matches the step's per-token mean in both of Megatron's modes; a stream's steps resume exactly. Where CUDA is
there: Megatron's own schedule, DDP and `finalize_model_grads` train a step fed by `MegatronStep` with the plain
loop's gradients (its schedules allocate on CUDA, so CI skips it; it passed on a lent H200, BENCHMARKS.md
"Megatron-Core's schedule on one GPU")."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from hf_models import family_dataset, packs_of  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402
from packfeed.client.frameworks.megatron import MegatronSteps, loss_func, megatron_batch, packed_seq_params  # noqa: E402


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    data = family_dataset(tmp_path_factory.mktemp("megatron"), "qwen2_vl")
    return data, packs_of(data, [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9]])


def hf_loss_sum(pack, logits: torch.Tensor, conventions) -> torch.Tensor:
    """What transformers computes for the pack: labels shifted inside the loss, summed."""
    labels = to_hf_inputs(pack, "qwen2_vl", conventions=conventions)["labels"][0]
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("pad,tail", [(1, 0), (4, 0), (4, 12)])
def test_a_megatron_batch_gives_the_hf_loss_and_megatrons_own_thd_split_takes_it(packs, pad, tail):
    """`tail`: every batch padded at its end to the longest's tokens plus that (what `same_length` does, for
    Megatron's pipelines)."""
    from megatron.core.utils import get_thd_batch_on_this_cp_rank

    data, served = packs
    length = max(megatron_batch(pack, pad_to_multiple=pad)["tokens"].shape[1] for pack in served) + tail if tail \
        else None
    for pack in served:
        batch = megatron_batch(pack, pad_to_multiple=pad, pad_to_length=length)
        real, padded = batch["cu_seqlens"].tolist(), batch["cu_seqlens_padded"].tolist()
        assert real == pack.cu_seqlens.tolist() and all(b % pad == 0 for b in padded)
        assert length is None or batch["tokens"].shape[1] == padded[-1] == length == batch["loss_mask"].shape[1]
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
        with PackStream(server.target, job="mcore-even", rank=0, **plan) as stream:  # the same packs, evened
            packed = next(iter(stream)).packs
        even_steps = MegatronSteps(PackStream(server.target, job="mcore-even", rank=0, **plan), pad_to_multiple=2,
                                   same_length=True)
        evened = next(even_steps)
        even_steps.stream.close()
    assert first.num_microbatches == 2 and first.seq_length >= max(b["tokens"].shape[1] for b in first.batches)
    assert (resumed.epoch, resumed.step) == (following.epoch, following.step) != (first.epoch, first.step)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(resumed.batches, following.batches))
    assert resumed.sample_keys == following.sample_keys and evened.sample_keys == [list(p.sample_keys) for p in packed]
    assert all(len(keys) == int(b["cu_seqlens"].numel()) - 1 for keys, b in zip(first.sample_keys, first.batches))
    assert len(list(first.data_iterator)) == 2 and "images" in first.batches[0]
    same = [megatron_batch(pack, 2, pad_to_length=first.seq_length) for pack in packed]  # what same_length gives
    assert [b["tokens"].shape[1] for b in evened.batches] == [first.seq_length] * 2
    assert all(torch.equal(a[key], b[key]) for a, b in zip(same, evened.batches) for key in ("tokens", "loss_mask"))
    assert sum(int(b["loss_mask"].sum()) for b in evened.batches) == sum(int(b["loss_mask"].sum()) for b in first.batches)
    with pytest.raises(ValueError, match="shorter than the batch"):
        megatron_batch(packed[0], 2, pad_to_length=1)


class PackedLM(torch.nn.Module):
    """A one-block causal LM that reads Megatron's THD batch the way its GPTModel does: every sample's tokens back
    to back, attention inside each sample's padded span (`PackedSeqParams.cu_seqlens_q_padded`), per-token
    losses out."""

    def __init__(self, config, vocab: int):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        dim = config.hidden_size
        self.embed, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(4096, dim)
        self.qkv, self.out, self.head = (torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim),
                                         torch.nn.Linear(dim, vocab))

    def set_input_tensor(self, tensor) -> None:  # Megatron's schedules call it on every stage; pp 1 has none
        pass

    def forward(self, tokens, position_ids, labels, packed_seq_params):
        hidden = self.embed(tokens[0]) + self.positions(position_ids[0])
        q, k, v = self.qkv(hidden).view(len(hidden), 3, self.config.num_attention_heads, -1).unbind(1)
        bounds = packed_seq_params.cu_seqlens_q_padded.tolist()
        attended = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True).transpose(0, 1).reshape(b - a, -1)
            for a, b in zip(bounds[:-1], bounds[1:])])
        logits = self.head(hidden + self.out(attended))
        return torch.nn.functional.cross_entropy(logits.float(), labels[0], reduction="none").unsqueeze(0)


@pytest.fixture
def megatron_on_one_gpu():
    """Megatron-Core's model-parallel state over one NCCL process (what its schedules need)."""
    import socket

    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Megatron-Core's schedules allocate on CUDA")
@pytest.mark.parametrize("per_token", [True, False])
def test_megatrons_own_schedule_and_gradient_sync_train_a_step_with_the_plain_loops_gradients(
        packs, megatron_on_one_gpu, per_token):
    """One step of M microbatches through Megatron-Core's own `forward_backward_func`, its DDP and its
    `finalize_model_grads` (both loss normalisations), fed by `MegatronStep.data_iterator`: every gradient
    equals the plain loop's over the same packs (the step's per-token mean), and a wrong normalisation differs."""
    import copy
    import functools

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packfeed.client.frameworks.megatron import MegatronStep

    data, served = packs
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               calculate_per_token_loss=per_token)
    torch.manual_seed(0)
    plain = PackedLM(config, data.vocab).cuda()
    step = MegatronStep(0, 0, [megatron_batch(p, pad_to_multiple=4, device="cuda") for p in served])
    summed = sum(loss_func(b, plain(b["tokens"], b["position_ids"], b["labels"], packed_seq_params(b)))[0]
                 for b in step.batches)
    (summed / served[0].step_loss_tokens).backward()
    expected = {name: p.grad.clone() for name, p in plain.named_parameters()}

    model = DistributedDataParallel(config, DistributedDataParallelConfig(), copy.deepcopy(plain))
    config.finalize_model_grads_func = finalize_model_grads
    model.zero_grad_buffer()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["labels"], packed_seq_params(batch))
        return output, functools.partial(loss_func, batch, per_token=per_token,
                                         num_microbatches=step.num_microbatches, dp=1)

    reports = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=step.data_iterator, model=[model],
        num_microbatches=step.num_microbatches, seq_length=step.seq_length, micro_batch_size=1)
    assert len(reports) == len(served)
    got = {name: p.main_grad for name, p in model.module.named_parameters()}
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    plain.zero_grad()  # control: the usual mean of each microbatch's mean, which the step's mean is not
    sum(loss_func(b, plain(b["tokens"], b["position_ids"], b["labels"], packed_seq_params(b)))[0]
        / b["loss_mask"].sum() for b in step.batches).div(len(served)).backward()
    assert max(float((got[n] - p.grad).abs().max()) for n, p in plain.named_parameters()) > 1e-4
