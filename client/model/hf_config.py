"""A `transformers` model config that matches a dataset, and the check that a model does (`packfeed.client.model.hf`
re-exports both: `model_config`, `check_model`).

`model_config(family, conventions, **sizes)` is the family's config whose vocabulary, placeholder ids and
vision geometry are the dataset's (`stream.conventions`, i.e. `JobInfo.conventions`), and whose other sizes
come from `sizes` (`text={...}` for the LLM's config, `vision={...}` for the vision tower's, any top-level
field beside them); without sizes, a small model that trains on a CPU in seconds:

- every family: `vocab_size` (the index's tokenizer, placeholders included) and `image_token_id`;
- internvl: the vision tower's `image_size` and `patch_size` (the policy's tile and patch), `downsample_ratio`
  from the tokens per tile;
- llava: `image_size`, `patch_size`, `image_seq_length` (tokens per tile), the projection to the LLM's width;
- qwen2_vl, qwen2_5_vl, qwen3_vl: `patch_size`, `spatial_merge_size` (the policy's factor / patch),
  `temporal_patch_size`, M-RoPE sections over the head dimension and `video_token_id` when the dataset has
  videos; qwen2_5_vl its window attention as released, qwen3_vl no deepstack layers unless given.

`check_model(model, conventions)` refuses, before any forward, a model that would fail deep inside
`transformers` on this dataset (an embedding smaller than the vocabulary: `IndexError: index out of range`;
another placeholder id: `Image features and image tokens do not match`), naming the field and both values.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
DEFAULT_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# the image policy (packfeed.media.image_policy) a family's processor follows: a dataset indexed with another
# policy has tiles and placeholder counts the family's vision tower cannot take
FAMILY_POLICY = {"internvl": "internvl", "llava": "fixed", **{family: "qwen2vl" for family in QWEN_FAMILIES}}
# what the dataset decides: a size of the caller's may not override it (the model would not fit the data)
FROM_DATASET = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                "downsample_ratio", "image_seq_length")


def _merge(base: dict[str, Any], override: dict[str, Any] | None) -> dict[str, Any]:
    return {**base, **(override or {})}


def model_config(family: str, conventions: Any, **sizes: Any):
    """The family's `transformers` config for a dataset with these conventions (see the module docstring)."""
    import transformers as tf

    if family not in FAMILY_POLICY:
        raise ValueError(f"unknown Hugging Face family {family!r}; choose one of {', '.join(FAMILY_POLICY)}")
    policy = conventions.image_policy
    if policy.name != FAMILY_POLICY[family]:
        fits = [name for name, wanted in FAMILY_POLICY.items() if wanted == policy.name]
        raise ValueError(f"family {family!r} takes datasets indexed with the {FAMILY_POLICY[family]!r} image policy; "
                         f"this one was indexed with {policy.name!r}: choose family {' or '.join(fits) or '(none)'}, "
                         f"or index the data with the {family} preset")
    fixed = sorted(set(sizes) & set(FROM_DATASET))  # (a larger text vocab_size is the caller's to choose)
    if fixed:
        raise ValueError(f"{', '.join(fixed)} come from the dataset's conventions (its tokenizer and placeholders): "
                         "leave them out, or index the data with the tokenizer you want")
    config = _family_config(tf, family, conventions, dict(sizes))
    _check_sizes(config, sizes)
    return config


def _check_sizes(config, sizes: dict[str, Any]) -> None:
    """A size that is not a field of the family's config but nearly spells one is a typo: transformers would
    keep it as an unused attribute and the model would silently take the default. (Other names pass: configs
    take legacy and shared fields, such as `rope_theta`, that are not among their defaults.)"""
    import difflib
    import inspect

    def typos(cls, given: dict, prefix: str = "") -> list[str]:
        known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters)
        return [f"{prefix}{name} (did you mean {prefix}{close[0]}?)" for name in given if name not in known
                and (close := difflib.get_close_matches(name, known, n=1, cutoff=0.85))]

    found = typos(type(config), {k: v for k, v in sizes.items() if k not in ("text", "vision")})
    for part, sub in (("text", config.get_text_config()), ("vision", getattr(config, "vision_config", None))):
        if sizes.get(part) and sub is not None:
            found += typos(type(sub), sizes[part], part + ".")
    if found:
        raise ValueError(f"unknown size(s) for {type(config).__name__}: {', '.join(found)}")


def _family_config(tf, family: str, conventions: Any, sizes: dict[str, Any]):
    text, vision = sizes.pop("text", None), sizes.pop("vision", None)
    policy = conventions.image_policy
    text_config = _merge({**DEFAULT_TEXT, "vocab_size": conventions.vocab_size}, text)
    image_token = conventions.image_context_id
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
    return _qwen_config(family, conventions, text_config, vision, sizes)


def _qwen_config(family: str, conventions: Any, text_config: dict, vision: dict | None, sizes: dict):
    import transformers as tf

    policy = conventions.image_policy
    patch = policy.patch_size
    merge = json.loads(policy.parameters_json or "{}").get("factor", 28) // patch
    head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
    quarter = head_dim // 2 // 4  # M-RoPE sections (temporal, height, width) over half the head dimension
    sections = [head_dim // 2 - 2 * quarter, quarter, quarter]
    image_token = conventions.image_context_id
    vision_common = {"depth": DEFAULT_VISION["num_hidden_layers"], "num_heads": DEFAULT_VISION["num_attention_heads"],
                     "patch_size": patch, "spatial_merge_size": merge,
                     "temporal_patch_size": policy.temporal_patch_size or 2}
    if conventions.HasField("video_context_id"):  # the dataset's video placeholder (Qwen's <|video_pad|>)
        sizes = {**sizes, "video_token_id": conventions.video_context_id}
    for name, field in (("vision_start_token_id", "image_start_id"), ("vision_end_token_id", "image_end_id")):
        if conventions.HasField(field):  # the dataset's <|vision_start|> / <|vision_end|>, inside its vocabulary
            sizes = {**sizes, name: getattr(conventions, field)}
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


def model_mismatches(model: Any, conventions: Any) -> list[str]:
    """What of `model` (a `transformers` model, or its config) disagrees with the dataset's conventions."""
    config = getattr(model, "config", model)
    problems = []
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        rows = getattr(text, "vocab_size", None)
    if rows is not None and rows < conventions.vocab_size:
        problems.append(f"vocabulary: the model's embedding has {rows} rows, the dataset's vocab_size is "
                        f"{conventions.vocab_size} (its token ids reach {conventions.vocab_size - 1})")
    image = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
    if image is not None and image != conventions.image_context_id:
        problems.append(f"image_token_id: the model's is {image}, the dataset's placeholder (image_context_id) is "
                        f"{conventions.image_context_id}")
    video = getattr(config, "video_token_id", None)
    if conventions.HasField("video_context_id") and video is not None and video != conventions.video_context_id:
        problems.append(f"video_token_id: the model's is {video}, the dataset's placeholder (video_context_id) is "
                        f"{conventions.video_context_id}")
    return problems


def check_model(model: Any, conventions: Any) -> None:
    """Refuse a model whose vocabulary or placeholder ids disagree with the dataset (ValueError naming each)."""
    problems = model_mismatches(model, conventions)
    if problems:
        raise ValueError("this model does not fit the dataset: " + "; ".join(problems) + ". Build it with "
                         "packfeed.client.model.hf.model_config(family, stream.conventions, ...), or index the data "
                         "with the model's own tokenizer and preset")
