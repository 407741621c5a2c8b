"""A VLM team's recipe as files on disk, written by the tests: image folders (real JPEG and PNG photographs,
some missing, one corrupt), a LLaVA JSON annotation, InternVL JSONL annotations and an InternVL meta file."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

QUESTIONS = ["What is shown in the image?", "Describe the picture in detail.", "What colour dominates here?"]
ANSWERS = ["A small photograph of a scene with several objects and a clear background.",
           "The picture shows a landscape.", "Mostly blue, with some grey towards the edges of the frame."]


def write_image(path: Path, rng: np.random.Generator, fmt: str = "JPEG") -> None:
    """A real photograph-sized image with random content and aspect ratio."""
    width, height = int(rng.integers(120, 900)), int(rng.integers(120, 900))
    pixels = rng.integers(0, 255, size=(height // 8, width // 8, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((width, height), Image.BILINEAR)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    path.write_bytes(buffer.getvalue())


def turns(rng: np.random.Generator, images: int) -> list[dict[str, str]]:
    question = "<image>\n" * images + str(rng.choice(QUESTIONS))
    return [{"from": "human", "value": question}, {"from": "gpt", "value": str(rng.choice(ANSWERS))}]


@dataclass
class Annotation:
    path: Path
    image_root: Path
    good_ids: list[str]  # rows that convert
    missing_ids: list[str]  # rows whose image does not exist
    bad_ids: list[str]  # rows with a corrupt image or a wrongly shaped conversation


def write_annotation(root: Path, name: str, rows: int, seed: int, jsonl: bool, missing: int = 2) -> Annotation:
    """`rows` samples over images under root/images-NAME; the last `missing` rows name images that are not there,
    and two more are broken (a corrupt image file, a conversation without an assistant turn)."""
    rng = np.random.default_rng(seed)
    images = root / f"images-{name}"
    entries, good, absent, bad = [], [], [], []
    for k in range(rows):
        sample_id = f"{name}-{k:04d}"
        n = 2 if k % 7 == 3 else 1
        files = [f"sub/{sample_id}-{j}.{'png' if (k + j) % 5 == 0 else 'jpg'}" for j in range(n)]
        if k >= rows - missing:
            absent.append(sample_id)
        else:
            for file in files:
                write_image(images / file, rng, "PNG" if file.endswith("png") else "JPEG")
        entry = {"id": sample_id, ("images" if n > 1 else "image"): files if n > 1 else files[0],
                 "conversations": turns(rng, n)}
        if k == 1:
            (images / files[0]).write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
            bad.append(sample_id)
        elif k == 2:
            entry["conversations"] = [{"from": "human", "value": "<image>\nHello?"}]
            bad.append(sample_id)
        elif sample_id not in absent:
            good.append(sample_id)
        entries.append(entry)
    path = root / f"{name}.{'jsonl' if jsonl else 'json'}"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n" if jsonl else json.dumps(entries))
    return Annotation(path, images, good, absent, bad)
