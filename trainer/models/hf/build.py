"""Real `transformers` VLMs built from a config (no hub download), sized for the dataset they train on.

`build_hf_model(family, conventions, sizes)` makes a randomly initialised model of the family whose vocabulary,
image placeholder id and vision geometry (tile size, patch size, tokens per tile, merge size) are those of the
dataset's conventions (`JobInfo.conventions`), and whose other sizes come from `sizes`:

    {"text": {hidden_size: 1024, num_hidden_layers: 12, ...},    # the LLM's config (any of its fields)
     "vision": {hidden_size: 256, ...},                          # the vision tower's config
     ...}                                                        # any top-level field of the family's config

Defaults are a small model that trains on a CPU in seconds. Loading pretrained weights is the user's
`from_pretrained`; `packfeed.client.hf.to_hf_inputs` feeds either.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from packfeed.client.hf import FAMILIES

DEFAULT_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
DEFAULT_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def _merge(base: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    return {**base, **(override or {})}


def hf_config(family: str, conventions: Any, sizes: dict[str, Any] | None = None):
    """The family's `transformers` config for a dataset with these conventions."""
    import transformers as tf

    sizes = dict(sizes or {})
    text, vision = sizes.pop("text", None), sizes.pop("vision", None)
    policy = conventions.image_policy
    parameters = json.loads(policy.parameters_json or "{}")
    vocab, image_token = conventions.vocab_size, conventions.image_context_id
    text_config = _merge({**DEFAULT_TEXT, "vocab_size": vocab}, text)
    if family == "internvl":
        side, patch = policy.tile_size, policy.patch_size
        downsample = (policy.tokens_per_tile / (side // patch) ** 2) ** 0.5
        vision_config = _merge({**DEFAULT_VISION, "image_size": [side, side], "patch_size": [patch, patch]}, vision)
        return tf.InternVLConfig(vision_config=vision_config, text_config={"model_type": "qwen2", **text_config},
                                 image_token_id=image_token, downsample_ratio=downsample, **sizes)
    if family == "llava":
        side, patch = policy.tile_size, policy.patch_size
        vision_config = _merge({**DEFAULT_VISION, "model_type": "clip_vision_model", "image_size": side,
                                "patch_size": patch, "projection_dim": text_config["hidden_size"]}, vision)
        return tf.LlavaConfig(vision_config=vision_config, text_config={"model_type": "llama", **text_config},
                              image_token_id=image_token, image_seq_length=policy.tokens_per_tile, **sizes)
    if family not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"unknown Hugging Face family {family!r}; choose one of {', '.join(FAMILIES)}")
    patch, merge = policy.patch_size, parameters.get("factor", 28) // policy.patch_size
    head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
    quarter = head_dim // 2 // 4  # M-RoPE sections (temporal, height, width) over half the head dimension
    sections = [head_dim // 2 - 2 * quarter, quarter, quarter]
    vision_common = {"depth": DEFAULT_VISION["num_hidden_layers"], "num_heads": DEFAULT_VISION["num_attention_heads"],
                     "patch_size": patch, "spatial_merge_size": merge,
                     "temporal_patch_size": policy.temporal_patch_size or 2}
    if conventions.HasField("video_context_id"):  # the dataset's video placeholder (Qwen's <|video_pad|>)
        sizes = {**sizes, "video_token_id": conventions.video_context_id}
    if family == "qwen2_vl":
        vision_config = _merge({**vision_common, "embed_dim": DEFAULT_VISION["hidden_size"],
                                "hidden_size": text_config["hidden_size"], "mlp_ratio": 2}, vision)
        text_config = _merge(text_config, {"rope_scaling": {"type": "mrope", "mrope_section": sections}})
        return tf.Qwen2VLConfig(vision_config=vision_config, text_config=text_config, image_token_id=image_token,
                                **sizes)
    vision_config = {**vision_common, "hidden_size": DEFAULT_VISION["hidden_size"],
                     "intermediate_size": DEFAULT_VISION["intermediate_size"],
                     "out_hidden_size": text_config["hidden_size"]}
    if family == "qwen2_5_vl":
        vision_config = _merge({**vision_config, "fullatt_block_indexes": [0], "window_size": patch * merge * 2,
                                "tokens_per_second": 2}, vision)  # as the released checkpoints (and the client)
        text_config = _merge(text_config, {"rope_scaling": {"type": "mrope", "mrope_section": sections}})
        return tf.Qwen2_5_VLConfig(vision_config=vision_config, text_config=text_config, image_token_id=image_token,
                                   **sizes)
    vision_config = _merge({**vision_config, "num_position_embeddings": 64, "deepstack_visual_indexes": []}, vision)
    text_config = _merge(text_config, {"head_dim": head_dim, "rope_scaling": {
        "rope_type": "default", "mrope_section": sections, "mrope_interleaved": True}})
    return tf.Qwen3VLConfig(vision_config=vision_config, text_config=text_config, image_token_id=image_token, **sizes)


def build_hf_model(family: str, conventions: Any, sizes: dict[str, Any] | None = None, attention: str = "sdpa",
                   seed: int = 0) -> torch.nn.Module:
    """A randomly initialised (seeded) model of the family for this dataset."""
    import transformers as tf

    classes = {"internvl": tf.InternVLForConditionalGeneration, "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
               "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
               "llava": tf.LlavaForConditionalGeneration}
    config = hf_config(family, conventions, sizes)
    torch.manual_seed(seed)
    return classes[family]._from_config(config, attn_implementation=attention)


def attention_implementation(choice: str, device: torch.device, packed: bool = False) -> str:
    """The `attn_implementation` to build the model with. auto: flash-attention 2 on CUDA when installed,
    otherwise Packfeed's variable-length kernel (sdpa per sample; on CPU 2.5x faster than HF's packed sdpa with
    its dense mask, BENCHMARKS.md). `packed`: for the pipeline's layers, which give attention the packed
    samples' bounds and no mask, so sdpa (which needs HF's mask) would let samples see each other."""
    from packfeed.client.hf import register_varlen_attention

    if choice == "auto" and device.type == "cuda":
        import importlib.util

        choice = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "varlen"
    if packed and choice == "sdpa":
        raise ValueError("model.hf_attention=sdpa needs the dense mask HF builds inside its forward, which pipeline "
                         "stages do not run: use auto, varlen (CPU or GPU) or flash_attention_2 (CUDA)")
    return register_varlen_attention() if choice in ("auto", "varlen") else choice
