"""What the rollout face hands an inference engine (`packfeed.client.rollouts.engine_io.engine_request`), from a real
prompt job on a real server: the index's tokens with each image's placeholders collapsed to one (an engine expands
them again from the image grid; an engine that takes them expanded gets the trainer's tokens back, each image's run
located), the loader server's pixel values untouched; placeholders that disagree with the images are refused,
never passed on; a vLLM server that does not answer is named."""

from __future__ import annotations

import pytest

from packfeed.client import LocalServer
from packfeed.client.rollouts.engine_io import Sampling, engine_request
from packfeed.client.rollouts.prompts import prompt_job_stream, prompts_of
from packfeed.client.stream.channel import PackfeedError
from packfeed.v1 import packfeed_pb2 as pb


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from hf_models import family_dataset

    data = family_dataset(tmp_path_factory.mktemp("prompts"), "qwen2_vl", samples=6)
    with LocalServer(data.index, workers=1) as server:
        stream = prompt_job_stream(server.target, "requests", consumers=1, consumer=0, per_consumer=6)
        found = [p for step in stream for pack in step.packs for p in prompts_of(pack, "qwen2_vl", stream.conventions)]
        conventions = stream.conventions
        stream.close()
    return found, conventions, data.tokenizer


def test_each_images_placeholders_collapse_to_one_and_its_pixels_stay_the_trainers(prompts):
    found, conventions, _ = prompts
    placeholder = conventions.image_context_id
    assert {len(p.fields.get("image_grid_thw", [])) for p in found} >= {0, 1, 2}
    for prompt in found:
        request = engine_request(prompt, conventions)
        images = request.images
        assert request.token_ids.count(placeholder) == images
        if images:
            expanded = sum(int(g.prod()) // conventions.image_policy.patches_per_unit for g in request.image_grid_thw)
            assert prompt.ids.count(placeholder) == expanded > images
            assert request.pixel_values is prompt.fields["pixel_values"]
        # the rest of the prompt is the index's tokens, in order
        assert [t for t in request.token_ids if t != placeholder] == [t for t in prompt.ids if t != placeholder]
        # expanded again (an engine that takes the prompt expanded): the trainer's tokens, each image's run located
        ids, spans = request.expanded()
        assert ids == prompt.ids and len(spans) == images
        for offset, length in spans:
            assert set(ids[offset:offset + length]) == {placeholder}
            assert ids[offset - 1] != placeholder and ids[offset + length] != placeholder


def test_placeholders_that_disagree_with_the_images_are_refused(prompts):
    found, conventions, _ = prompts
    other = pb.ModelConventions()
    other.CopyFrom(conventions)
    other.image_policy.patches_per_unit = 1  # each placeholder would stand for one patch: the runs are too short
    with_image = next(p for p in found if p.fields)
    with pytest.raises(PackfeedError, match="image placeholders run"):
        engine_request(with_image, other)
    text = next(p for p in found if not p.fields)
    assert engine_request(text, other).token_ids == text.ids  # a text prompt has nothing to disagree


def test_a_requests_seed_depends_on_the_runs_seed_and_the_prompt_alone():
    sampling = Sampling(seed=3)
    assert sampling.seed_of("s1") == Sampling(seed=3, temperature=0.5).seed_of("s1")
    assert sampling.seed_of("s1") != sampling.seed_of("s2") and sampling.seed_of("s1") != Sampling(seed=4).seed_of("s1")
    with pytest.raises(ValueError, match="max_tokens"):
        Sampling(max_tokens=0)


def test_a_vllm_server_that_does_not_answer_is_named(prompts, tmp_path):
    from ports import free_port

    from packfeed.client.rollouts.vllm_server import VLLMServerEngine

    _, _, tokenizer = prompts
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(PackfeedError, match=f"the vLLM server at {url} did not answer GET /server_info"):
        VLLMServerEngine(url, tokenizer=tokenizer, timeout_s=5)
