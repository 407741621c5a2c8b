"""Named sizes of each model (torchtitan's split of model name and flavor): `model.hf` names the model (the
reference VLM when empty, else a `transformers` family) and `model.flavor` its sizes; sizes given one by one
(`model.llm_dim=...`, `model.hf_config={text: {...}}`) override the flavor's.

The vocabulary, tile size and tokens per tile (and a `transformers` model's image token and vision geometry)
are never a flavor's: they come from the dataset's conventions the server reports.
"""

from __future__ import annotations

from typing import Any

# the reference VLM: its size fields (packfeed.trainer.models.reference.VLMConfig)
REFERENCE_FLAVORS: dict[str, dict[str, Any]] = {
    # trains on a CPU in seconds (tests, the demo)
    "tiny": dict(vit_dim=64, vit_layers=4, vit_heads=4, llm_dim=128, llm_layers=4, llm_heads=4, mlp_ratio=4.0,
                 ffn_multiple=1),
    # about 2B parameters: a 300M ViT (1024 wide, 24 blocks) and a 1.5B LLM (2048 wide, 30 blocks, SwiGLU 5,632
    # wide: a multiple of 256 for tensor cores), plus the dataset's vocabulary (65M more at 32K)
    "2b": dict(vit_dim=1024, vit_layers=24, vit_heads=16, llm_dim=2048, llm_layers=30, llm_heads=16, mlp_ratio=4.0,
               ffn_multiple=256),
}

# `transformers` families: {text: {...}, vision: {...}, top-level fields} over packfeed.trainer.models.hf.build's
# defaults (which are "tiny")
QWEN2_VL_2B = {"text": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                        "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1_000_000.0,
                        "tie_word_embeddings": True},
               "vision": {"embed_dim": 1280, "depth": 32, "num_heads": 16, "mlp_ratio": 4},
               "tie_word_embeddings": True}
HF_FLAVORS: dict[str, dict[str, dict[str, Any]]] = {
    "internvl": {"tiny": {}},
    "qwen2_vl": {"tiny": {}, "2b": QWEN2_VL_2B},  # Qwen2-VL-2B's sizes (2.2B parameters)
    "qwen2_5_vl": {"tiny": {}},
    "qwen3_vl": {"tiny": {}},
    "llava": {"tiny": {}},
}


def flavors_of(hf: str) -> list[str]:
    """The flavors of the model `hf` names ("" = the reference VLM)."""
    return list(HF_FLAVORS[hf] if hf else REFERENCE_FLAVORS)


def check_flavor(hf: str, flavor: str) -> None:
    if flavor not in flavors_of(hf):
        raise ValueError(f"model.flavor = {flavor!r}: {hf or 'the reference VLM'} comes in "
                         f"{', '.join(flavors_of(hf))} (or give its sizes one by one)")


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` over `base`, section by section ({text: {...}} replaces only the fields it names)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def hf_sizes(hf: str, flavor: str, given: dict[str, Any]) -> dict[str, Any]:
    """The sizes a `transformers` model is built with: its flavor's, then the ones `given` (model.hf_config)."""
    check_flavor(hf, flavor)
    return merged(HF_FLAVORS[hf][flavor], given)
