"""A prompt and its images computed once (issue [4/6]): a group's members laid out as [prefix, response 1, ...,
response G] give every response's log-probabilities and the loss's gradients of each response after its own copy
of the prompt, within 1e-5, for the reference VLM and Hugging Face qwen2_vl, with images in the prompt and
G = 1, 3, 8; a control where a response may see a sibling differs. The unshared side is built here, sample by
sample, from the dataset's real packs, not by the code under test."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from hf_models import family_dataset, packs_of, tiny_model  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402
from packfeed.client.model.shared_prefix import shared, unshared  # noqa: E402
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors  # noqa: E402

IMAGE_SAMPLE = 2  # the family datasets' sample 2 has two images in its prompt
OTHER_SAMPLE = 1  # ... and sample 1 one image: a sample of no group in the same pack


def _responses(g: int, vocab: int, avoid: set[int], seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(10, vocab) if t not in avoid])
    return [torch.tensor(rng.choice(allowed, int(rng.integers(3, 14))), dtype=torch.int32) for _ in range(g)]


def _cat_packs(parts: list[PackTensors], rows: list[list[int]] | None, step_loss: int) -> PackTensors:
    """One pack of whole samples `parts` (each a one-sample pack; images kept where `rows` leaves them), with
    its shared_prefix rows."""
    names = ("input_ids", "labels", "position_ids", *(n for n in parts[0].tensors if n.startswith("token.")))
    tensors: dict[str, list] = {name: [] for name in names}
    bounds, spans, image_sample, tile_image, shapes, pixels = [0], [], [], [], [], []
    for k, part in enumerate(parts):
        offset = bounds[-1]
        for name in tensors:
            tensors[name].append(part.tensors[name])
        bounds.append(offset + int(part.input_ids.numel()))
        for span, tile_of in zip(part.image_token_spans.view(-1, 2).tolist(), range(part.image_sample.numel())):
            spans.append([span[0] + offset, span[1]])
            image_sample.append(k)
        images_before = len(set(tile_image))
        tile_image += [images_before + t for t in part.tile_image.tolist()]
        shapes += part.tile_shapes.view(-1, 3).tolist()
        pixels.append(part.pixels)
    out = {name: torch.cat(values) for name, values in tensors.items()}
    out.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
               image_token_spans=torch.tensor(spans, dtype=torch.int32).view(-1, 2),
               image_sample=torch.tensor(image_sample, dtype=torch.int32),
               tile_image=torch.tensor(tile_image, dtype=torch.int32),
               tile_shapes=torch.tensor(shapes, dtype=torch.int32).view(-1, 3), pixels=torch.cat(pixels))
    if rows is not None:
        out["shared_prefix"] = torch.tensor(rows, dtype=torch.int32)
    loss = sum(int((part.labels != IGNORE_INDEX).sum()) for part in parts)
    return PackTensors(0, 0, 0, 0, False, [f"s{k}" for k in range(len(parts))], loss, step_loss, [], out)


def _strip_images(part: PackTensors) -> PackTensors:
    empty = {"image_token_spans": torch.zeros(0, 2, dtype=torch.int32), "image_sample": torch.zeros(0, dtype=torch.int32),
             "tile_image": torch.zeros(0, dtype=torch.int32), "tile_shapes": torch.zeros(0, 3, dtype=torch.int32),
             "pixels": torch.zeros(0, dtype=torch.uint8)}
    return replace(part, tensors={**part.tensors, **empty})


def group_packs(data, g: int, seed: int = 0) -> tuple[PackTensors, list[PackTensors]]:
    """(the wire pack of a group of g responses to sample IMAGE_SAMPLE's prompt plus sample OTHER_SAMPLE alone,
    the same samples as one-sample packs, each with its own images)."""
    prompt_pack, other = packs_of(data, [[IMAGE_SAMPLE], [OTHER_SAMPLE]])
    labels = prompt_pack.labels
    prompt = int(torch.nonzero(labels != IGNORE_INDEX)[0])  # the prompt: every token before the first loss token
    image_ids = {int(t) for t in prompt_pack.input_ids[prompt_pack.image_token_spans[:, 0].long()]}
    members = []
    rng = np.random.default_rng(seed)
    for response in _responses(g, data.vocab, image_ids, seed):
        ids = torch.cat([prompt_pack.input_ids[:prompt], response])
        per_token = {f"token.{name}": torch.from_numpy(rng.normal(scale=scale, size=len(ids)).astype("float32"))
                     for name, scale in (("advantages", 1.0), ("old_logprobs", 0.1))}
        part = replace(prompt_pack, tensors={**prompt_pack.tensors, **per_token, "input_ids": ids,
                                             "labels": torch.cat([labels[:prompt], response]),
                                             "position_ids": torch.arange(len(ids), dtype=torch.int32),
                                             "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32)})
        members.append(part)
    other = replace(other, tensors={**other.tensors, **{name: torch.zeros(int(other.input_ids.numel()))
                                                         for name in members[0].tensors if name.startswith("token.")}})
    alone = members + [other]
    step_loss = sum(int((p.labels != IGNORE_INDEX).sum()) for p in alone)
    wire_parts = [members[0]] + [_strip_images(m) for m in members[1:]] + [other]
    rows = [[0, prompt]] * g + [[g, 0]]
    wire = _cat_packs(wire_parts, rows, step_loss)
    singles = [_cat_packs([p], None, step_loss) for p in alone]
    return wire, singles


def response_logprobs(logits: torch.Tensor, pack: PackTensors, sources: torch.Tensor | None = None) -> dict:
    """{(sample, token offset): log-probability of that loss token}, read from a row's logits (L, vocab)."""
    ids, labels = pack.input_ids.long(), pack.labels.long()
    bounds = pack.cu_seqlens.tolist()
    logp = torch.log_softmax(logits.double(), -1)
    original = sources if sources is not None else torch.arange(len(ids))
    segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1]))
    out = {}
    for j in range(1, len(ids)):
        if labels[j] != IGNORE_INDEX and segment[j] == segment[j - 1]:
            out[int(original[j])] = float(logp[j - 1, ids[j]])
    return out


def keyed(logprobs: dict, bounds: list[int], sample_offset: int = 0) -> dict:
    """Re-key {token index in a pack: value} as {(sample, offset within it): value}."""
    out = {}
    for index, value in logprobs.items():
        k = int(np.searchsorted(bounds, index, side="right")) - 1
        out[(k + sample_offset, index - bounds[k])] = value
    return out


def hf_run(model, inputs: dict) -> tuple[torch.Tensor, float, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.logits[0].detach(), out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    data = family_dataset(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")
    return data, tiny_model("qwen2_vl", data)


def _compare_hf(model, wire, singles, attention="sdpa", control=False):
    laid = shared(wire)
    inputs = to_hf_inputs(wire, "qwen2_vl", shared_prefix=True, attention=attention)
    if control:  # a response may see its siblings: the row's plain causal mask
        length = inputs["input_ids"].shape[1]
        inputs["attention_mask"] = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    logits, loss, grads = hf_run(model, inputs)
    got = keyed(response_logprobs(logits, laid, laid.source), wire.cu_seqlens.tolist())
    expected, total, summed = {}, 0.0, {}
    for k, single in enumerate(singles):
        s_logits, s_loss, s_grads = hf_run(model, to_hf_inputs(single, "qwen2_vl"))
        expected.update(keyed(response_logprobs(s_logits, single), single.cu_seqlens.tolist(), k))
        total += s_loss
        for name, value in s_grads.items():
            summed[name] = summed[name] + value if name in summed else value
    return got, expected, loss, total, grads, summed


@pytest.mark.parametrize("g", [1, 3, 8])
def test_qwen2_vl_shared_prefix_equals_each_response_after_its_own_prompt(qwen, g):
    data, model = qwen
    wire, singles = group_packs(data, g, seed=g)
    laid = shared(wire)
    # the prompt's tokens once, its two images encoded once (and the other sample's one)
    assert int(laid.input_ids.numel()) == int(wire.input_ids.numel()) - (g - 1) * (int(wire.shared_prefix[0, 1]) - 1)
    assert int(laid.image_sample.numel()) == 3
    got, expected, loss, total, grads, summed = _compare_hf(model, wire, singles)
    assert got.keys() == expected.keys() and len(got) == sum(int((s.labels != -100).sum()) for s in singles) - len(singles) * 0
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert loss == pytest.approx(total, abs=1e-5)
    assert grads.keys() == summed.keys()
    for name in summed:
        torch.testing.assert_close(grads[name], summed[name], rtol=0, atol=1e-5, msg=name)
    assert any(grads[name].abs().sum() > 0 for name in grads if "visual" in name)  # the vision tower trains too
    # the unshared wire layout (each sibling with its owner's images copied) is the same loss too
    _, whole_loss, _ = hf_run(model, to_hf_inputs(wire, "qwen2_vl"))
    assert whole_loss == pytest.approx(total, abs=1e-5)
    assert int(unshared(wire).image_sample.numel()) == 2 * g + 1


def test_qwen2_vl_control_a_response_seeing_a_sibling_differs(qwen):
    data, model = qwen
    wire, singles = group_packs(data, 3, seed=7)
    got, expected, loss, total, _, _ = _compare_hf(model, wire, singles, control=True)
    assert max(abs(got[k] - expected[k]) for k in expected) > 1e-3


def test_qwen2_vl_varlen_kernel_shares_the_prefix_too(qwen):
    from packfeed.client.model.hf import register_varlen_attention

    data, _ = qwen
    varlen = tiny_model("qwen2_vl", data, attention=register_varlen_attention())
    wire, singles = group_packs(data, 3, seed=11)
    got, expected, loss, total, grads, summed = _compare_hf(varlen, wire, singles, attention="varlen")
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    for name in summed:
        torch.testing.assert_close(grads[name], summed[name], rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    return family_dataset(tmp_path_factory.mktemp("internvl"), "internvl")


def reference_run(layers, config, pack: PackTensors) -> tuple[torch.Tensor, float, dict]:
    """The reference VLM on one pack as `packfeed train` feeds it: (its row's logits, summed loss, gradients)."""
    from types import SimpleNamespace

    from packfeed.trainer.models.reference import run_layers
    from packfeed.trainer.models.reference_inputs import microbatches_of

    step = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
    args = microbatches_of(step, config, token_multiple=1).args
    layers.zero_grad(set_to_none=True)
    hidden = run_layers(layers[:-1], args)
    head = layers[-1]
    loss = head(*hidden)[0]
    loss.backward()
    logits = head.out(head.norm(hidden[0])).detach()
    return logits[:int(shared(pack).input_ids.numel())], loss.item(), {
        n: p.grad.clone() for n, p in layers.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("g", [1, 3, 8])
def test_reference_vlm_shared_prefix_equals_each_response_after_its_own_prompt(internvl, g):
    from packfeed.trainer.models.reference import VLMConfig, build_layers, sized_model

    config = sized_model(VLMConfig(patch_size=14), internvl.conventions)
    layers = build_layers(config)
    wire, singles = group_packs(internvl, g, seed=g)
    laid = shared(wire)
    assert int(laid.tile_shapes.shape[0]) < int(unshared(wire).tile_shapes.shape[0]) or g == 1
    logits, loss, grads = reference_run(layers, config, wire)
    got = keyed(response_logprobs(logits, laid, laid.source), wire.cu_seqlens.tolist())
    expected, total, summed = {}, 0.0, {}
    for k, single in enumerate(singles):
        s_logits, s_loss, s_grads = reference_run(layers, config, single)
        expected.update(keyed(response_logprobs(s_logits, single), single.cu_seqlens.tolist(), k))
        total += s_loss
        for name, value in s_grads.items():
            summed[name] = summed[name] + value if name in summed else value
    assert got.keys() == expected.keys() and got
    for key in expected:
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert loss == pytest.approx(total, rel=1e-6)
    for name in summed:  # the loss is summed over tokens here: gradients compared relative to their scale
        torch.testing.assert_close(grads[name], summed[name], rtol=0, atol=1e-5 * max(1.0, float(summed[name].abs().max())),
                                   msg=name)
    assert any(grads[name].abs().sum() > 0 for name in grads if name.startswith("0.") or name.startswith("1."))


def test_reference_vlm_control_a_response_seeing_a_sibling_differs(internvl):
    """The same pack with its responses' segments made one (each sees the siblings before it) is not the same."""
    from packfeed.trainer.models.reference import VLMConfig, build_layers, sized_model

    config = sized_model(VLMConfig(patch_size=14), internvl.conventions)
    layers = build_layers(config)
    wire, singles = group_packs(internvl, 3, seed=5)
    laid = shared(wire)
    bounds = laid.cu_seqlens.tolist()  # the owner whole, 2 responses, the other sample: the responses joined
    assert len(bounds) == 5
    joined = replace(laid, tensors={**laid.tensors, "cu_seqlens": torch.tensor([bounds[0], bounds[3], bounds[4]],
                                                                               dtype=torch.int32)})
    joined.tensors.pop("shared_prefix", None)
    logits, _, _ = reference_run(layers, config, joined)
    got = keyed(response_logprobs(logits, laid, laid.source), wire.cu_seqlens.tolist())
    expected = {}
    for k, single in enumerate(singles):
        s_logits, _, _ = reference_run(layers, config, single)
        expected.update(keyed(response_logprobs(s_logits, single), single.cu_seqlens.tolist(), k))
    assert max(abs(got[k] - expected[k]) for k in expected) > 1e-3


@pytest.mark.parametrize("g", [3, 8])
def test_qwen2_vl_clipped_policy_loss_on_the_shared_prefix_equals_each_response_alone(qwen, g):
    """GRPO's loss over the pack's per-token advantages and old log-probabilities (packfeed.client.model.losses): the
    same loss and gradients with the prompt once as with every response after its own prompt."""
    from packfeed.client.model.losses import clipped_policy_loss, row_tensors, token_logprobs, weighted_token_loss

    data, model = qwen
    wire, singles = group_packs(data, g, seed=20 + g)
    normalizer = wire.step_loss_tokens / 2

    def run(pack, share: bool):
        model.zero_grad(set_to_none=True)
        inputs = to_hf_inputs(pack, "qwen2_vl", shared_prefix=share)
        labels = inputs.pop("labels")[0]
        logits = model(**inputs).logits[0]
        tensors = row_tensors(pack, shared_prefix=share)
        logp, mask = token_logprobs(logits, labels)
        loss = clipped_policy_loss(logp, tensors["old_logprobs"], tensors["advantages"], mask, normalizer,
                                   epsilon=0.2, epsilon_high=0.28) \
            + weighted_token_loss(logp, tensors["advantages"], mask, normalizer)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = run(wire, True)
    total, summed = 0.0, {}
    for single in singles:
        s_loss, s_grads = run(single, False)
        total += s_loss
        for name, value in s_grads.items():
            summed[name] = summed[name] + value if name in summed else value
    assert loss == pytest.approx(total, abs=1e-5) and abs(total) > 1e-3
    for name in summed:
        torch.testing.assert_close(grads[name], summed[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("lengths", [[5, 12, 3, 9], [40, 6, 50, 2], [1, 30, 30]])
def test_segment_attention_equals_the_dense_mask(lengths):
    """`segment_attention` (a prefix shorter than its segment through a causal call, a longer one through a
    mask) gives the outputs and gradients of attention under the dense mask `segment_mask` builds, for segments
    continuing a prefix and segments alone."""
    from packfeed.client.model.attention import segment_attention
    from packfeed.client.model.hf import segment_mask

    bounds = [0, *np.cumsum(lengths + [7]).tolist()]  # the segments continuing segment 0, then one alone
    parents = [-1] + [0] * (len(lengths) - 1) + [-1]
    torch.manual_seed(len(lengths))
    q, k, v = (torch.randn(bounds[-1], 2, 8, requires_grad=True) for _ in range(3))
    assert_masked_attention(q, k, v, segment_attention(q, k, v, bounds, parents), segment_mask(bounds, parents)[0, 0])


def assert_masked_attention(q, k, v, got: torch.Tensor, mask: torch.Tensor) -> None:
    """`got` (rows x heads x dim) is attention of q, k, v under the dense `mask`: its outputs and gradients."""
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    weights = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * weights).sum(), (q, k, v)),
                    torch.autograd.grad((expected * weights).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_trainers_hf_layers_compute_the_prompt_once_with_each_responses_loss(qwen):
    """`packfeed train model.hf=qwen2_vl` (its layer list, Packfeed's varlen kernel) on a group's pack: laid out
    with the prompt once, the loss and gradients of the same samples as one-sample packs."""
    from packfeed.client.model.hf import register_varlen_attention
    from packfeed.client.stream.tensors import Step
    from packfeed.trainer.models.hf.model import HFLayerModel

    data, _ = qwen
    model = HFLayerModel("qwen2_vl", data.conventions,
                         model=tiny_model("qwen2_vl", data, register_varlen_attention()))
    wire, singles = group_packs(data, 4, seed=31)

    def step(packs):
        batch = model.inputs(Step(0, 0, 0, packs), 16, 1)
        total = 0.0
        for k in range(len(packs)):
            carrier = batch.microbatch(k, len(packs))
            for layer in model.layers:
                carrier = layer(*carrier)
            loss = carrier[0].sum()
            loss.backward()
            total += float(loss.detach())
        grads = {names[local]: p.grad.clone() for layer, names in zip(model.layers, model.parameter_names)
                 for local, p in layer.named_parameters(remove_duplicate=False) if p.grad is not None}
        model.hf.zero_grad(set_to_none=True)
        return total, grads, batch.real_tokens

    loss, grads, tokens = step([wire])
    alone_loss, alone_grads, alone_tokens = step(singles)
    assert tokens < alone_tokens  # the prompt once
    assert loss == pytest.approx(alone_loss, rel=1e-6)
    for name in alone_grads:
        torch.testing.assert_close(grads[name], alone_grads[name], rtol=1e-5,
                                   atol=1e-5 * max(1.0, float(alone_grads[name].abs().max())), msg=name)


def test_a_packs_loss_per_dataset_is_the_same_in_both_layouts_and_as_each_sample_alone(qwen):
    """A loss-driven mixture's report (packfeed.client.model.dataset_losses): the group's members of one dataset and the
    other sample of another, read from the shared row, the unshared row and each sample's own pack, agree."""
    from packfeed.client.model.dataset_losses import sums_by_dataset, token_losses

    data, model = qwen
    wire, singles = group_packs(data, 3, seed=5)
    wire = replace(wire, sample_sources=["math"] * 3 + ["chat"])
    expected: dict[str, list[float]] = {}
    with torch.no_grad():
        for k, single in enumerate(singles):  # each alone: its loss tokens' mean next-token loss, by hand
            logits = model(**to_hf_inputs(single, "qwen2_vl")).logits[0].double()
            ids, labels = single.input_ids.long(), single.labels.long()
            logp = torch.log_softmax(logits, -1)
            picked = [-float(logp[j - 1, ids[j]]) for j in range(1, len(ids)) if labels[j] != IGNORE_INDEX]
            entry = expected.setdefault("chat" if k == 3 else "math", [0.0, 0])
            entry[0] += sum(picked)
            entry[1] += len(picked)
        for share in (True, False):
            inputs = to_hf_inputs(wire, "qwen2_vl", shared_prefix=share)
            got = sums_by_dataset(wire, *token_losses(model(**inputs).logits[0], inputs["labels"][0]), share)
            assert got.keys() == expected.keys()
            for name, (total, tokens) in expected.items():
                assert got[name][1] == tokens and got[name][0] == pytest.approx(total, abs=1e-4), (share, name)
