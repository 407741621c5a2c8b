"""Real `transformers` VLMs built from a config (no hub download), sized for the dataset they train on.

`build_hf_model(family, conventions, sizes)` makes a randomly initialised model of the family whose config is
`packfeed.client.model.hf.model_config`'s: vocabulary, image placeholder id and vision geometry (tile size, patch size,
tokens per tile, merge size) those of the dataset's conventions (`JobInfo.conventions`), other sizes from `sizes`:

    {"text": {hidden_size: 1024, num_hidden_layers: 12, ...},    # the LLM's config (any of its fields)
     "vision": {hidden_size: 256, ...},                          # the vision tower's config
     ...}                                                        # any top-level field of the family's config

Defaults are a small model that trains on a CPU in seconds. Loading pretrained weights is the user's
`from_pretrained`; `packfeed.client.model.hf.to_hf_inputs` feeds either.
"""

from __future__ import annotations

from typing import Any

import torch

from packfeed.client.model.hf_config import model_config


def build_hf_model(family: str, conventions: Any, sizes: dict[str, Any] | None = None, attention: str = "sdpa",
                   seed: int = 0) -> torch.nn.Module:
    """A randomly initialised (seeded) model of the family for this dataset."""
    import transformers as tf

    classes = {"internvl": tf.InternVLForConditionalGeneration, "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
               "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
               "llava": tf.LlavaForConditionalGeneration}
    config = model_config(family, conventions, **dict(sizes or {}))
    torch.manual_seed(seed)
    return classes[family]._from_config(config, attn_implementation=attention)


def attention_implementation(choice: str, device: torch.device, packed: bool = False) -> str:
    """The `attn_implementation` to build the model with. auto: flash-attention 2 on CUDA when installed,
    otherwise Packfeed's variable-length kernel (sdpa per sample; on CPU 2.5x faster than HF's packed sdpa with
    its dense mask, BENCHMARKS.md). `packed`: for the pipeline's layers, which give attention the packed
    samples' bounds and no mask, so sdpa (which needs HF's mask) would let samples see each other."""
    from packfeed.client.model.hf import register_varlen_attention

    if choice == "auto" and device.type == "cuda":
        import importlib.util

        choice = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "varlen"
    if packed and choice == "sdpa":
        raise ValueError("model.hf_attention=sdpa needs the dense mask HF builds inside its forward, which pipeline "
                         "stages do not run: use auto, varlen (CPU or GPU) or flash_attention_2 (CUDA)")
    return register_varlen_attention() if choice in ("auto", "varlen") else choice
