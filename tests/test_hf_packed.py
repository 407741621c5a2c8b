"""Packed training of real `transformers` VLMs (tiny random configs of each family, built offline): the packed
loss and gradients equal running every sample alone, for packs with text-only, one-image and two-image samples;
a control that breaks isolation (positions that do not restart) differs, so the check can fail."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import CONVENTIONS, family_dataset, packs_of, tiny_model  # noqa: E402
from packfeed.client.model.hf import to_hf_inputs  # noqa: E402

GROUPS = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9]]  # 3 and 7 samples: text-only, one and two images mixed
TEXT_ONLY = [[0, 4, 9]]


def loss_and_grads(model, inputs: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def summed(results) -> tuple[float, dict[str, torch.Tensor]]:
    total, grads = 0.0, {}
    for loss, g in results:
        total += loss
        for name, value in g.items():
            grads[name] = grads[name] + value if name in grads else value
    return total, grads


def assert_packed_equals_alone(model, name: str, packs, alone, **kwargs) -> tuple[float, dict[str, torch.Tensor]]:
    """Packed loss and gradients (summed over `packs`) equal the samples' run alone (`alone`); returns them."""
    packed = summed(loss_and_grads(model, to_hf_inputs(p, name, **kwargs)) for p in packs)
    reference = summed(loss_and_grads(model, to_hf_inputs(p, name, **kwargs)) for p in alone)
    assert packed[0] == pytest.approx(reference[0], rel=1e-5, abs=1e-6)
    assert packed[1].keys() == reference[1].keys()
    for key in reference[1]:
        torch.testing.assert_close(packed[1][key], reference[1][key], rtol=1e-4, atol=1e-5, msg=key)
    return packed


@pytest.fixture(scope="module", params=sorted(CONVENTIONS))
def family(request, tmp_path_factory):
    data = family_dataset(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, data, tiny_model(request.param, data)


def test_packed_loss_and_gradients_equal_each_sample_alone(family):
    name, data, model = family
    for groups in (GROUPS, TEXT_ONLY):
        packs = packs_of(data, groups)
        alone = packs_of(data, [[i] for group in groups for i in group])
        for single in alone:
            single.step_loss_tokens = packs[0].step_loss_tokens  # the same normalisation: the step's tokens
        packed = assert_packed_equals_alone(model, name, packs, alone, image_token_id=data.image_token_id)
        vision = [g for k, g in packed[1].items() if "vision" in k or "visual" in k]
        assert bool(vision) == (groups is GROUPS)
        assert groups is not GROUPS or any(g.abs().sum() > 0 for g in vision)  # the vision tower trains too


def test_varlen_attention_equals_each_sample_alone(family):
    """Packfeed's variable-length CPU attention (sdpa per sample, no L x L mask) gives the per-sample loss and
    gradients too."""
    from packfeed.client.model.hf import register_varlen_attention

    name, data, model = family
    varlen = tiny_model(name, data, attention=register_varlen_attention())
    packs = packs_of(data, GROUPS)
    alone = packs_of(data, [[i] for group in GROUPS for i in group])
    for single in alone:
        single.step_loss_tokens = packs[0].step_loss_tokens
    packed = summed(loss_and_grads(varlen, to_hf_inputs(p, name, attention="varlen")) for p in packs)
    reference = summed(loss_and_grads(model, to_hf_inputs(p, name)) for p in alone)
    assert packed[0] == pytest.approx(reference[0], rel=1e-5, abs=1e-6)
    for key in reference[1]:
        torch.testing.assert_close(packed[1][key], reference[1][key], rtol=1e-4, atol=1e-5, msg=key)


def test_padded_layout_equals_each_sample_alone(family):
    """`layout="padded"` (HF's usual collation: a row per sample, an attention mask) trains the same as the pack:
    the baseline packing is measured against learns the same thing per step."""
    name, data, model = family
    packs = packs_of(data, GROUPS)
    alone = packs_of(data, [[i] for group in GROUPS for i in group])
    for single in alone:
        single.step_loss_tokens = packs[0].step_loss_tokens
    padded = [to_hf_inputs(p, name, layout="padded", device="cpu") for p in packs]  # tiles normalised "there"
    assert padded[1]["input_ids"].shape[0] == len(GROUPS[1]) and int(padded[1]["attention_mask"].sum()) == \
        len(packs[1].input_ids)
    batched = summed(loss_and_grads(model, inputs) for inputs in padded)
    reference = summed(loss_and_grads(model, to_hf_inputs(p, name)) for p in alone)
    assert batched[0] == pytest.approx(reference[0], rel=1e-5, abs=1e-6)
    for key in reference[1]:
        torch.testing.assert_close(batched[1][key], reference[1][key], rtol=1e-4, atol=1e-5, msg=key)
    with pytest.raises(ValueError, match="attention='sdpa'"):
        to_hf_inputs(packs[0], name, layout="padded", attention="varlen")


def test_a_control_that_breaks_isolation_differs(family):
    """The packed logits equal each sample's own; with positions counted across the whole pack (not restarting
    per sample) HF attends across samples and they differ by far more than the tolerance."""
    name, data, model = family
    group = GROUPS[1]
    (pack,) = packs_of(data, [group])
    inputs = to_hf_inputs(pack, name, image_token_id=data.image_token_id)
    with torch.no_grad():
        alone = torch.cat([model(**to_hf_inputs(p, name)).logits[0] for p in packs_of(data, [[i] for i in group])])
        isolated = model(**inputs).logits[0]
        length = inputs["input_ids"].shape[1]
        broken = dict(inputs)
        if inputs["position_ids"].dim() == 3:  # Qwen: (4, 1, L)
            broken["position_ids"] = torch.arange(length).view(1, 1, -1).expand(4, 1, -1)
        else:
            broken["position_ids"] = torch.arange(length).unsqueeze(0)
        crossed = model(**broken).logits[0]
    torch.testing.assert_close(isolated, alone, rtol=1e-4, atol=1e-5)
    assert (crossed - alone).abs().max() > 100 * 1e-5


def test_placeholder_counts_are_checked(family):
    name, data, _ = family
    (pack,) = packs_of(data, [[1, 2]])
    with pytest.raises(ValueError, match="image placeholder tokens"):
        to_hf_inputs(pack, name, image_token_id=data.image_token_id + 1 if data.image_token_id else 1)


def test_dp_divides_the_step_normalisation(family):
    """Under DDP / FSDP gradients are averaged over the DP ranks, so each rank divides by step tokens / dp."""
    name, data, _ = family
    (pack,) = packs_of(data, [[1, 3]])
    one, two = (to_hf_inputs(pack, name, dp=dp)["num_items_in_batch"] for dp in (1, 2))
    assert float(one) == pack.step_loss_tokens and float(two) == pack.step_loss_tokens / 2


def test_no_sample_learns_its_first_token_from_the_previous_one(family):
    """Samples whose every token is trained (no template marker first): the packed loss still equals each
    sample alone, because labels are masked at every sample start (HF shifts labels inside the loss)."""
    import numpy as np

    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.serve.packs import assemble_pack
    from packfeed.server.serve.preprocess import SampleTensors
    from packfeed.server.serve.wire import encode_pack

    name, data, model = family
    rng = np.random.default_rng(1)
    samples = [SampleTensors(f"t{k}", ids, ids.copy(), [], [], [], [])
               for k, ids in enumerate(rng.integers(5, data.vocab - 5, size=(3, 9)).astype(np.int32))]

    def packed(group):
        pack = assemble_pack(group, 0, 0, 0, 0)
        pack.step_loss_tokens = 27
        return pack_of(encode_pack(pack, 1, False))

    together = loss_and_grads(model, to_hf_inputs(packed(samples), name))[0]
    alone = sum(loss_and_grads(model, to_hf_inputs(packed([s]), name))[0] for s in samples)
    assert together == pytest.approx(alone, rel=1e-5)


def test_model_config_is_the_datasets(family):
    """`model_config`: the dataset's vocabulary, placeholder id and vision geometry in the family's config; the
    family's model built from it passes `check_model`, and one placeholder id off fails it."""
    import copy
    import json

    from packfeed.client.model.hf import check_model, model_config

    name, data, model = family
    conventions = data.conventions
    config = model_config(name, conventions, text={"hidden_size": 32, "num_attention_heads": 4})
    policy = conventions.image_policy
    assert config.get_text_config().vocab_size == conventions.vocab_size == data.vocab
    assert config.image_token_id == conventions.image_context_id == data.image_token_id
    assert config.get_text_config().hidden_size == 32
    vision = config.vision_config
    if name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        factor = json.loads(policy.parameters_json or "{}").get("factor", 28)
        assert (vision.patch_size, vision.spatial_merge_size) == (policy.patch_size, factor // policy.patch_size)
    else:
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        assert patch == policy.patch_size
    check_model(model, conventions)
    off = copy.deepcopy(model.config)
    off.image_token_id += 1
    with pytest.raises(ValueError, match="image_token_id"):
        check_model(off, conventions)
    if conventions.HasField("image_start_id") and name.startswith("qwen"):  # M-RoPE finds images by these
        assert (config.vision_start_token_id, config.vision_end_token_id) == (conventions.image_start_id,
                                                                              conventions.image_end_id)
        assert max(config.vision_start_token_id, config.vision_end_token_id) < conventions.vocab_size
    other = "internvl" if name != "internvl" else "qwen2_vl"  # another family's dataset: said, not a ZeroDivision
    with pytest.raises(ValueError, match=f"family '{other}' takes datasets indexed with"):
        model_config(other, conventions)
    with pytest.raises(ValueError, match="unknown Hugging Face family 'qwen9'"):
        model_config("qwen9", conventions)
    with pytest.raises(ValueError, match="image_token_id come from the dataset"):
        model_config(name, conventions, image_token_id=5)
    with pytest.raises(ValueError, match=r"unknown size\(s\) .*text.hidden_sise \(did you mean text.hidden_size"):
        model_config(name, conventions, text={"hidden_sise": 32})
