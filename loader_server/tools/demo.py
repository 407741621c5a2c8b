"""A small, real demo dataset: photographs from scikit-image's bundled data, WebDataset shards, a tokenizer.

Samples hold zero, one or several images of varied sizes (random crops and resizes of the photos, saved
as JPEG or PNG) and LLaVA-style conversations of varied length. A few deliberately bad samples show how
indexing reports them. Everything is seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg", "retina.jpg",
          "motorcycle_left.png", "ihc.png", "camera.png", "page.png")

SENTENCES = (
    "The photograph shows a scene with strong contrast between light and shadow.",
    "In the foreground there is an object whose edges are sharp and well defined.",
    "The background is blurred, which draws attention to the subject.",
    "Colours range from warm oranges to cool blues across the frame.",
    "A small detail near the corner suggests the picture was taken indoors.",
    "The texture of the surface looks rough, with fine repeating patterns.",
    "Several shapes overlap, creating a sense of depth in the composition.",
    "The lighting appears to come from the left side of the image.",
    "There is text visible, although part of it is cut off at the border.",
    "Compared with the other picture, this one is brighter and more saturated.",
    "The answer is that the largest region occupies roughly a third of the area.",
    "Counting carefully, there are more than five distinct objects in view.",
    "Scientists use images like this one to measure structures too small to see.",
    "The chart would rise steadily from left to right if the trend continued.",
    "A cat rests calmly while looking straight at the camera.",
    "The telescope image contains thousands of faint galaxies at different distances.",
    "Blood vessels branch out from a bright disc in the retina photograph.",
    "The rocket stands upright on the launch pad under a clear sky.",
    "Coffee in a white cup sits on a saucer next to a spoon.",
    "The stained tissue sample shows cells in shades of brown and blue.",
)
QUESTIONS = (
    "What is shown in this image?", "Describe the picture in detail.", "How many objects can you count?",
    "What colours dominate the scene?", "Compare the two images.", "What might happen next?",
    "Is there any text in the image? Transcribe it.", "Explain the lighting of this photograph.",
    "Write a short story about this scene.", "What is the main subject and why does it stand out?",
)
TEXT_QUESTIONS = ("Summarise the following idea in your own words.", "Explain how a telescope works.",
                  "Give three tips for taking better photographs.", "Why is the sky blue?")


@dataclass
class DemoPaths:
    root: Path
    shards: list[Path]
    tokenizer: Path


def _photo_dir() -> Path:
    import skimage  # the demo extra; only its bundled data files are used

    return Path(os.path.dirname(skimage.__file__)) / "data"


def _load_photos() -> list[Image.Image]:
    root = _photo_dir()
    return [Image.open(root / name).convert("RGB") for name in PHOTOS if (root / name).exists()]


def _random_image(rng: np.random.Generator, photos: list[Image.Image]) -> tuple[bytes, str]:
    photo = photos[rng.integers(len(photos))]
    w, h = photo.size
    cw, ch = int(w * rng.uniform(0.5, 1.0)), int(h * rng.uniform(0.5, 1.0))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = photo.crop((x, y, x + cw, y + ch))
    long_side = int(rng.choice([160, 320, 448, 640, 900, 1280, 1600]))
    scale = long_side / max(crop.size)
    crop = crop.resize((max(16, int(crop.width * scale)), max(16, int(crop.height * scale))), Image.BILINEAR)
    buffer = io.BytesIO()
    if long_side > 640 or rng.random() < 0.7:  # PNG only for small images: keeps the demo light
        crop.save(buffer, format="JPEG", quality=88)
        return buffer.getvalue(), "jpg"
    crop.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue(), "png"


def _paragraph(rng: np.random.Generator, mean_sentences: float) -> str:
    n = 1 + int(rng.geometric(1.0 / mean_sentences))
    return " ".join(SENTENCES[i] for i in rng.integers(0, len(SENTENCES), size=n))


def _conversation(rng: np.random.Generator, n_images: int) -> dict:
    turns = []
    for t in range(int(rng.geometric(0.6))):
        question = QUESTIONS[rng.integers(len(QUESTIONS))] if n_images else TEXT_QUESTIONS[
            rng.integers(len(TEXT_QUESTIONS))]
        if t == 0 and n_images:
            question = "".join(f"Image-{k + 1}: <image>\n" for k in range(n_images)) if n_images > 1 \
                else "<image>\n" + question
            if n_images > 1:
                question += QUESTIONS[rng.integers(len(QUESTIONS))]
        turns.append({"from": "human", "value": question})
        turns.append({"from": "gpt", "value": _paragraph(rng, mean_sentences=float(rng.choice([1.5, 4, 10])))})
    return {"conversations": turns}


def corpus_lines() -> list[str]:
    """Text the demo tokenizer is trained on: everything conversations can contain."""
    return list(SENTENCES) + list(QUESTIONS) + list(TEXT_QUESTIONS) + [f"Image-{k}: " for k in range(1, 9)]


def train_tokenizer(path: Path, vocab_size: int = 2000, special_tokens: list[str] | None = None) -> Path:
    """A small byte-level BPE trained on the demo corpus, with `special_tokens` (default: those of the default
    chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from packfeed.media.chat import ChatTemplate

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens or ChatTemplate().special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_lines() * 4 + ["user", "assistant", "system"], trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def write_demo_dataset(root: Path, samples: int = 240, shards: int = 4, seed: int = 0,
                       bad_samples: bool = True) -> DemoPaths:
    """Write `samples` samples over `shards` tar shards (with webdataset's TarWriter) and a tokenizer."""
    import webdataset as wds

    rng = np.random.default_rng(seed)
    photos = _load_photos()
    if not photos:
        raise RuntimeError("scikit-image's bundled photos were not found; install packfeed[demo]")
    root.mkdir(parents=True, exist_ok=True)
    shard_dir = root / "shards"
    shard_dir.mkdir(exist_ok=True)
    paths = []
    per_shard = -(-samples // shards)
    for s in range(shards):
        path = shard_dir / f"demo-{s:05d}.tar"
        paths.append(path)
        with wds.TarWriter(str(path)) as writer:
            for i in range(s * per_shard, min(samples, (s + 1) * per_shard)):
                writer.write(_demo_sample(rng, photos, i, bad_samples))
    tokenizer = train_tokenizer(root / "tokenizer.json")
    return DemoPaths(root, paths, tokenizer)


def _demo_sample(rng: np.random.Generator, photos, i: int, bad_samples: bool) -> dict:
    kind = rng.random()
    n_images = 0 if kind < 0.15 else 1 if kind < 0.75 else int(rng.integers(2, 5))
    sample: dict = {"__key__": f"sample{i:06d}"}
    for k in range(n_images):
        data, ext = _random_image(rng, photos)
        sample[f"{k}.{ext}" if n_images > 1 else ext] = data
    sample["json"] = json.dumps(_conversation(rng, n_images)).encode()
    if bad_samples and i % 97 == 13:  # a few broken samples, of every kind the index reports
        flaw = (i // 97) % 4
        if flaw == 0:
            sample["json"] = b'{"conversations": [{"from": "human", "value": "unterminated'
        elif flaw == 1:
            sample["json"] = b'{"conversations": [{"from": "gpt", "value": "caf\xe9"}]}'
        elif flaw == 2 and n_images:
            key = next(k for k in sample if k.endswith(("jpg", "png")))
            sample[key] = sample[key][: len(sample[key]) // 3]  # truncated image data
        else:
            sample["json"] = json.dumps({"conversations": []}).encode()
    return sample
