"""Multi-turn trajectories as trees, computed once (issue [5/6]): a tree of six-turn trajectories with images at
turns 0, 2 and 4 and forks at two depths, laid out with every shared turn once, gives every trained token's
log-probability and the loss's gradients of each trajectory computed alone (built by the test, turn by turn:
tests/trajectory_data.py) within 1e-5, for a tiny Qwen2-VL (sdpa and Packfeed's varlen kernel) and the reference
VLM; a control where a branch sees its sibling differs by more than 1e-3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import family_dataset, tiny_model  # noqa: E402
from packfeed.client.model.hf import segment_mask, to_hf_inputs  # noqa: E402
from packfeed.client.model.losses import clipped_policy_loss, sample_logprobs, weighted_token_loss  # noqa: E402
from packfeed.client.model.shared_prefix import continued_segments, shared, unshared  # noqa: E402
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors  # noqa: E402
from trajectory_data import concatenated, tree_of_turns, tree_packs  # noqa: E402

EPSILON, EPSILON_HIGH = 0.2, 0.28


def by_hand(logits: torch.Tensor, pack: PackTensors, normalizer: float) -> tuple[dict, torch.Tensor]:
    """A one-sample pack's {token: log-probability} of its trained tokens and its GRPO loss (the clipped policy
    loss plus REINFORCE on the advantages), written out here token by token."""
    ids, labels = pack.input_ids.long(), pack.labels.long()
    logp = torch.log_softmax(logits.float(), -1)
    advantages, old = pack.tensors["token.advantages"], pack.tensors["token.old_logprobs"]
    out, loss = {}, torch.zeros((), dtype=logp.dtype)
    for j in range(1, len(ids)):
        if labels[j] == IGNORE_INDEX:
            continue
        value = logp[j - 1, ids[j]]
        out[j] = float(value)
        ratio = torch.exp(value - old[j])
        loss = loss - torch.minimum(ratio * advantages[j], ratio.clamp(1 - EPSILON, 1 + EPSILON_HIGH) * advantages[j])
        loss = loss - advantages[j] * value
    return out, loss / normalizer


def tree_loss(logits: torch.Tensor, wire: PackTensors, normalizer: float) -> tuple[dict, torch.Tensor]:
    """The tree row's {(trajectory, token): log-probability} and GRPO loss through Packfeed's losses."""
    logp, mask = sample_logprobs(logits, wire, shared_prefix=True)
    tensors = wire.token_tensors
    loss = clipped_policy_loss(logp, tensors["old_logprobs"], tensors["advantages"], mask, normalizer,
                               epsilon=EPSILON, epsilon_high=EPSILON_HIGH) \
        + weighted_token_loss(logp, tensors["advantages"], mask, normalizer)
    bounds = wire.cu_seqlens.tolist()
    found = {}
    for t in np.flatnonzero(mask.numpy()).tolist():
        k = int(np.searchsorted(bounds, t, side="right")) - 1
        found[(k, t + 1 - bounds[k])] = float(logp[t].detach())
    return found, loss


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def compare(got: dict, expected: dict, loss, total, grads, summed, atol: float = 1e-5) -> None:
    assert got.keys() == expected.keys() and got
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert float(loss) == pytest.approx(float(total), abs=1e-5) and abs(float(total)) > 1e-3
    assert grads.keys() == summed.keys()
    for name in summed:
        torch.testing.assert_close(grads[name], summed[name], rtol=0,
                                   atol=atol * max(1.0, float(summed[name].abs().max())), msg=name)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    data = family_dataset(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")
    return data, tiny_model("qwen2_vl", data)


def _qwen_runs(model, wire, singles, attention="sdpa", control=False):
    normalizer = wire.step_loss_tokens / 2
    model.zero_grad(set_to_none=True)
    inputs = to_hf_inputs(wire, "qwen2_vl", shared_prefix=True, attention=attention)
    inputs.pop("labels")
    if control:  # a branch sees every row before it: its siblings' turns too
        length = inputs["input_ids"].shape[1]
        inputs["attention_mask"] = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    got, loss = tree_loss(model(**inputs).logits[0], wire, normalizer)
    loss.backward()
    grads = grads_of(model)
    expected, total, summed = {}, 0.0, {}
    for k, single in enumerate(singles):
        model.zero_grad(set_to_none=True)
        inputs = to_hf_inputs(single, "qwen2_vl")
        inputs.pop("labels")
        found, s_loss = by_hand(model(**inputs).logits[0], single, normalizer)
        s_loss.backward()
        expected.update({(k, j): value for j, value in found.items()})
        total += float(s_loss)
        for name, value in grads_of(model).items():
            summed[name] = summed[name] + value if name in summed else value
    return got, expected, float(loss), total, grads, summed


def test_a_tree_is_laid_out_with_each_shared_turn_and_image_once(qwen):
    data, _ = qwen
    trajectories = tree_of_turns(data, seed=1)
    wire, singles = tree_packs(trajectories)
    laid = shared(wire)
    alone_tokens = sum(int(s.input_ids.numel()) for s in singles)
    own_tokens = sum(len(t.ids) - max(t.shared_tokens() - 1, 0) for t in trajectories)  # a fork repeats one token
    assert int(laid.input_ids.numel()) == own_tokens < alone_tokens
    own_images = sum(len(turn.images) for t in trajectories for turn in t.turns[t.fork:])
    assert int(laid.image_sample.numel()) == own_images == int(wire.image_sample.numel())
    assert int(unshared(wire).image_sample.numel()) == sum(int(s.image_sample.numel()) for s in singles) > own_images
    # a model reading positions alone finds the same tree (the reference model, the trainer's HF layers)
    parents, starts = continued_segments(laid.cu_seqlens, laid.position_ids)
    assert parents == laid.segment_parents.tolist() and starts == laid.segment_starts.tolist()
    assert sorted(laid.segment_parents.tolist()).count(-1) == 2  # the tree's root and the trajectory alone


@pytest.mark.parametrize("seed", [1, 2])
def test_qwen2_vl_tree_equals_each_trajectory_alone(qwen, seed):
    data, model = qwen
    wire, singles = tree_packs(tree_of_turns(data, seed=seed))
    got, expected, loss, total, grads, summed = _qwen_runs(model, wire, singles)
    compare(got, expected, loss, total, grads, summed)
    assert any(grads[name].abs().sum() > 0 for name in grads if "visual" in name)  # the vision tower trains too


def test_qwen2_vl_varlen_kernel_computes_the_tree_too(qwen):
    from packfeed.client.model.hf import register_varlen_attention

    data, _ = qwen
    varlen = tiny_model("qwen2_vl", data, attention=register_varlen_attention())
    wire, singles = tree_packs(tree_of_turns(data, seed=3))
    compare(*_qwen_runs(varlen, wire, singles, attention="varlen"))


def test_qwen2_vl_control_a_branch_seeing_its_sibling_differs(qwen):
    data, model = qwen
    wire, singles = tree_packs(tree_of_turns(data, seed=4))
    got, expected, *_ = _qwen_runs(model, wire, singles, control=True)
    assert max(abs(got[k] - expected[k]) for k in expected) > 1e-3


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    return family_dataset(tmp_path_factory.mktemp("internvl"), "internvl")


def _reference_logits(layers, config, pack: PackTensors) -> torch.Tensor:
    """The reference VLM's logits of one pack's row, fed as `packfeed train` feeds it (laid out with
    `microbatches_of`)."""
    from types import SimpleNamespace

    from packfeed.trainer.models.reference import run_layers
    from packfeed.trainer.models.reference_inputs import microbatches_of

    step = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
    hidden = run_layers(layers[:-1], microbatches_of(step, config, token_multiple=1).args)
    head = layers[-1]
    return head.out(head.norm(hidden[0]))[:int(shared(pack).input_ids.numel())]


@pytest.mark.parametrize("control", [False, True])
def test_reference_vlm_tree_equals_each_trajectory_alone(internvl, control):
    from packfeed.trainer.models.reference import VLMConfig, build_layers, sized_model

    config = sized_model(VLMConfig(patch_size=14), internvl.conventions)
    layers = build_layers(config)
    wire, singles = tree_packs(tree_of_turns(internvl, seed=5))
    normalizer = wire.step_loss_tokens / 2
    fed = wire
    if control:  # every trajectory whole, its turns' images its own: the tree's rows on the positions' rule
        # joined, so a branch sees the rows of the segments before it
        laid = shared(wire)
        fed = PackTensors(0, 0, 0, 0, False, ["row"], wire.loss_tokens, wire.step_loss_tokens, [],
                          {**{n: t for n, t in laid.tensors.items() if n not in ("segment_parents", "source",
                                                                                 "placement", "segment_starts")},
                           "position_ids": torch.arange(int(laid.input_ids.numel()), dtype=torch.int32),
                           "cu_seqlens": torch.tensor([0, int(laid.input_ids.numel())], dtype=torch.int32)})
        logits = _reference_logits(layers, config, fed)
    else:
        logits = _reference_logits(layers, config, wire)
    layers.zero_grad(set_to_none=True)
    got, loss = tree_loss(logits, wire, normalizer)
    loss.backward()
    grads = grads_of(layers)
    expected, total, summed = {}, 0.0, {}
    for k, single in enumerate(singles):
        layers.zero_grad(set_to_none=True)
        found, s_loss = by_hand(_reference_logits(layers, config, single), single, normalizer)
        s_loss.backward()
        expected.update({(k, j): value for j, value in found.items()})
        total += float(s_loss)
        for name, value in grads_of(layers).items():
            summed[name] = summed[name] + value if name in summed else value
    if control:
        assert max(abs(got[k] - expected[k]) for k in expected) > 1e-3
        return
    compare(got, expected, float(loss), total, grads, summed)
    assert any(grads[name].abs().sum() > 0 for name in grads if name.startswith("0.") or name.startswith("1."))


def test_segment_attention_on_a_tree_equals_the_dense_mask():
    """`segment_attention` over a tree's segments (contexts shorter and longer than their segment, three
    depths) gives the outputs and gradients of attention under the dense mask `segment_mask` builds."""
    from packfeed.client.model.attention import segment_attention
    from test_shared_prefix import assert_masked_attention

    lengths = [30, 12, 40, 6, 9, 20]
    bounds = [0, *np.cumsum(lengths).tolist()]
    parents = [-1, 0, 1, 1, 0, -1]
    starts = [0, 10, 15, 20, 25, 0]  # each within its parent's positions
    torch.manual_seed(0)
    q, k, v = (torch.randn(bounds[-1], 2, 8, requires_grad=True) for _ in range(3))
    got = segment_attention(q, k, v, bounds, parents, starts=starts)
    mask = segment_mask(bounds, parents, starts)[0, 0]
    assert bool(mask[bounds[2], bounds[1]]) and not bool(mask[bounds[2], bounds[1] + 6])  # its parent up to 15 - 10
    assert not bool(mask[bounds[3], bounds[2]])  # never a sibling
    assert_masked_attention(q, k, v, got, mask)


def test_a_malformed_tree_is_refused_naming_what_is_wrong(qwen):
    data, _ = qwen
    wire, _ = tree_packs(tree_of_turns(data, seed=6))
    rows = wire.shared_prefix.view(-1, 2).clone()

    def refused(new_rows, *, ids=None) -> str:
        tensors = {**wire.tensors, "shared_prefix": new_rows}
        if ids is not None:
            tensors["input_ids"] = ids
        with pytest.raises(ValueError) as error:
            shared(PackTensors(0, 0, 0, 0, False, wire.sample_keys, wire.loss_tokens, wire.step_loss_tokens, [],
                               tensors))
        return str(error.value)

    later = rows.clone()
    later[1, 0] = 3  # a parent after its child
    assert "earlier in the pack" in refused(later)
    ids = wire.input_ids.clone()
    ids[int(wire.cu_seqlens[1]) + 1] += 1  # trajectory 1 does not start as its parent does
    assert "does not start with the" in refused(rows, ids=ids)
    trajectories = tree_of_turns(data, seed=6)
    with_copies = concatenated(trajectories, [0] * len(trajectories), wire.step_loss_tokens, rows.tolist())
    with pytest.raises(ValueError, match="carries an image in its first"):  # a child's shared images sent again
        shared(with_copies)


def test_packfeed_train_reference_loss_on_a_tree_is_each_trajectory_alone(internvl):
    """The reference trainer's own summed loss (its head) on a tree: a shared trained turn is counted once per
    trajectory holding it, so loss and gradients are those of the trajectories as one-sample packs."""
    from types import SimpleNamespace

    from packfeed.trainer.models.reference import VLMConfig, build_layers, run_layers, sized_model
    from packfeed.trainer.models.reference_inputs import microbatches_of

    config = sized_model(VLMConfig(patch_size=14), internvl.conventions)
    layers = build_layers(config)
    wire, singles = tree_packs(tree_of_turns(internvl, seed=8))

    def run(pack):
        step = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
        layers.zero_grad(set_to_none=True)
        loss = layers[-1](*run_layers(layers[:-1], microbatches_of(step, config, token_multiple=1).args))[0]
        loss.backward()
        return float(loss), grads_of(layers)

    loss, grads = run(wire)
    total, summed = 0.0, {}
    for single in singles:
        s_loss, s_grads = run(single)
        total += s_loss
        for name, value in s_grads.items():
            summed[name] = summed[name] + value if name in summed else value
    assert loss == pytest.approx(total, rel=1e-6)
    once = int((shared(wire).labels != IGNORE_INDEX).sum())
    assert once < sum(int((s.labels != IGNORE_INDEX).sum()) for s in singles)  # shared trained turns exist
    for name in summed:
        torch.testing.assert_close(grads[name], summed[name], rtol=0,
                                   atol=1e-5 * max(1.0, float(summed[name].abs().max())), msg=name)


@pytest.mark.parametrize("masked", [1, 0])
def test_the_reference_loss_follows_each_trajectorys_own_mask_on_a_shared_turn(internvl, masked):
    """A shared action turn trained by one trajectory and not by another (trajectory `masked` leaves turn 1 out of
    its loss, on the wire and alone): the reference trainer's loss on the tree is still each trajectory's alone."""
    from types import SimpleNamespace

    from packfeed.trainer.models.reference import VLMConfig, build_layers, run_layers, sized_model
    from packfeed.trainer.models.reference_inputs import microbatches_of

    config = sized_model(VLMConfig(patch_size=14), internvl.conventions)
    layers = build_layers(config)
    trajectories = tree_of_turns(internvl, seed=9)
    wire, singles = tree_packs(trajectories)
    turn0, turn1 = (len(t.ids) for t in trajectories[masked].turns[:2])
    start = int(wire.cu_seqlens[masked])
    wire.tensors["labels"] = wire.labels.clone()
    wire.labels[start + turn0:start + turn0 + turn1] = IGNORE_INDEX
    singles[masked].tensors["labels"] = singles[masked].labels.clone()
    singles[masked].labels[turn0:turn0 + turn1] = IGNORE_INDEX

    def loss_of(pack) -> float:
        step = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
        with torch.no_grad():
            return float(layers[-1](*run_layers(layers[:-1], microbatches_of(step, config, token_multiple=1).args))[0])

    assert loss_of(wire) == pytest.approx(sum(loss_of(single) for single in singles), rel=1e-6)
