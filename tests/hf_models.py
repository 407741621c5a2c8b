"""Tiny random `transformers` VLMs of each supported family, built offline from configs, and a dataset indexed
with each family's conventions (tiny images so the tests run on CPU in seconds)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipe_data import write_image

HIDDEN, LAYERS = 32, 2  # the LLM; the vision towers keep packfeed.trainer.models.hf.build's small defaults

# family -> (chat template preset, image policy at tiny sizes)
CONVENTIONS = {
    "internvl": ("internvl", {"name": "internvl", "image_size": 56, "max_num": 4, "tokens_per_tile": 4}),
    "qwen2_vl": ("qwen2vl", {"name": "qwen2vl", "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 9}),
    "qwen2_5_vl": ("qwen2vl", {"name": "qwen2vl", "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 9}),
    "qwen3_vl": ("qwen2vl", {"name": "qwen2vl", "factor": 32, "patch_size": 16, "min_pixels": 32 * 32,
                             "max_pixels": 32 * 32 * 9, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}),
    "llava": ("llava", {"name": "fixed", "size": 56, "tokens": 16, "resize": "crop"}),
}


# Deeper towers for pipeline tests: several vision blocks per family, Qwen2.5-VL's window and full attention,
# Qwen3-VL's DeepStack (features of two vision blocks added after the first two decoder layers), and LLaVA
# reading its penultimate CLIP layer (the last one is computed and thrown away, as the model does)
PIPELINE_SIZES = {
    "internvl": {"vision": {"num_hidden_layers": 2}},
    "qwen2_vl": {"vision": {"depth": 2}},
    "qwen2_5_vl": {"vision": {"depth": 3, "fullatt_block_indexes": [1]}},
    "qwen3_vl": {"vision": {"depth": 3, "deepstack_visual_indexes": [0, 2]}},
    "llava": {"vision": {"num_hidden_layers": 3}},
}


def tiny_sizes(family: str, deep: bool = False, layers: int = LAYERS) -> dict:
    sizes = {"text": {"hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": layers}}
    return {**sizes, **PIPELINE_SIZES[family]} if deep else sizes


def tiny_model(family: str, data: "FamilyData", attention: str = "sdpa", deep: bool = False, layers: int = LAYERS):
    """A randomly initialised model of the family (seeded) sized from the dataset's served conventions, in eval
    mode (no dropout); `deep`: the pipeline tests' deeper vision towers."""
    from packfeed.trainer.models.hf.build import build_hf_model

    return build_hf_model(family, data.conventions, tiny_sizes(family, deep, layers), attention).eval()


@dataclass
class FamilyData:
    index: Path
    tokenizer: Path
    vocab: int
    image_token_id: int
    conventions: object  # the ModelConventions a server reports for this dataset


def family_dataset(root: Path, family: str, seed: int = 0, samples: int = 10,
                   image_counts: tuple[int, ...] = (0, 1, 2, 1, 0, 1, 2, 1, 1, 0), prefix: str = "") -> FamilyData:
    """`samples` samples (sample k holds image_counts[k % len(image_counts)] images: text-only, one, two; answers of several
    lengths) converted and indexed with the family's conventions; their keys `{prefix}s{k}`."""
    from packfeed.media.chat import PRESETS
    from packfeed.server.convert.convert import ConvertOptions, convert, shard_paths
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.index.table import read_index_info
    from packfeed.server.serve.model_conventions import model_conventions
    from packfeed.server.tools.demo import train_tokenizer
    from tokenizers import Tokenizer

    template_preset, policy = CONVENTIONS[family]
    template = PRESETS[template_preset]
    rng = np.random.default_rng(seed)
    images = root / "images"
    rows = []
    for k in range(samples):
        n = image_counts[k % len(image_counts)]
        names = [f"s{k}-{j}.jpg" for j in range(n)]
        for name in names:
            write_image(images / name, rng)
        question = "<image>\n" * n + ["What is shown?", "Describe it.", "Which colour?"][k % 3]
        answer = " ".join(["A small photograph of a scene."] * (1 + k % 4))
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        if k % 5 == 4:
            turns += [{"from": "human", "value": "And more?"}, {"from": "gpt", "value": "Nothing else."}]
        rows.append({"id": f"{prefix}s{k}", "images": names, "conversations": turns})
    (root / "a.json").write_text(json.dumps(rows))
    convert(ConvertOptions("llava", str(root / "a.json"), str(root / "shards"), str(images), workers=1, progress=False))
    tokenizer = train_tokenizer(root / "tokenizer.json", vocab_size=400, special_tokens=template.special_tokens)
    config = IndexConfig(str(tokenizer), policy, template.to_dict())
    build_index(shard_paths(root / "shards"), root / "index.parquet", config, workers=1, progress=False)
    loaded = Tokenizer.from_file(str(tokenizer))
    conventions = model_conventions(read_index_info(root / "index.parquet"), tokenizer)
    return FamilyData(root / "index.parquet", tokenizer, loaded.get_vocab_size(),
                      loaded.token_to_id(template.image_context), conventions)


def packs_of(data: FamilyData, groups: list[list[int]]):
    """PackTensors of the given groups of sample ids (as the server builds and sends them), each with the
    step's loss tokens = all groups together."""
    from packfeed.client.stream.tensors import pack_of
    from packfeed.server.index.table import read_index
    from packfeed.server.serve.packs import assemble_pack
    from packfeed.server.serve.preprocess import SampleReader
    from packfeed.server.serve.wire import encode_pack

    table, info = read_index(data.index)
    rows = table.to_pylist()
    reader = SampleReader(info, data.tokenizer)
    packs = [assemble_pack([reader.load(rows[i]) for i in group], 0, 0, 0, m) for m, group in enumerate(groups)]
    step_loss = sum(p.loss_tokens for p in packs)
    for pack in packs:
        pack.step_loss_tokens = step_loss
    return [pack_of(encode_pack(pack, len(packs), False)) for pack in packs]
