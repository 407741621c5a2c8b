"""Conversation -> token ids and labels: the one chat-template implementation the index and the server share.

The index records `len(input_ids)` of exactly what the server will later produce for the same sample,
so planned pack lengths are the lengths that reach the trainer.

Template (ChatML, as InternVL-Chat uses with InternLM2): every turn is
``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Each ``<image>`` tag in a human turn becomes
``<img>`` + ``<IMG_CONTEXT>`` x (that image's LLM tokens) + ``</img>``. Labels are -100 everywhere except
the content and closing ``<|im_end|>`` of assistant turns.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tokenizers import Tokenizer

IGNORE_INDEX = -100
IMAGE_TAG = "<image>"
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class ConversationError(ValueError):
    """A sample's conversation cannot be used; the message is the reason recorded in the index."""


@dataclass(frozen=True)
class ChatTemplate:
    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    image_start: str = "<img>"
    image_end: str = "</img>"
    image_context: str = "<IMG_CONTEXT>"
    system_prompt: str | None = None

    @property
    def special_tokens(self) -> list[str]:
        return [self.turn_start, self.turn_end, self.image_start, self.image_end, self.image_context]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_tokenizer(path: str | Path, template: ChatTemplate) -> Tokenizer:
    """Any HF `tokenizers` tokenizer.json; the template's special tokens are added when missing.

    Adding is deterministic (fixed order, appended ids), so every process gets the same ids. Text is encoded
    with special tokens read as plain text: a sample that writes `<IMG_CONTEXT>` or `<|im_end|>` gets the ids
    of those characters, never the template's ids, which only the template itself places.
    """
    tokenizer = Tokenizer.from_file(str(path))
    missing = [t for t in template.special_tokens if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
    tokenizer.encode_special_tokens = True
    return tokenizer


@lru_cache(maxsize=8)
def cached_tokenizer(path: str, template: ChatTemplate) -> Tokenizer:
    return load_tokenizer(path, template)


def parse_conversation(raw: bytes) -> list[dict[str, str]]:
    """Decode a sample's JSON member into a list of turns, or raise ConversationError with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConversationError(f"bad utf-8 in json: byte {error.start}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConversationError(f"invalid json: {error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise ConversationError("invalid json: nested too deeply") from None
    turns = doc.get("conversations") if isinstance(doc, dict) else None
    if not isinstance(turns, list):
        raise ConversationError("invalid json: no 'conversations' list")
    if not turns:
        raise ConversationError("empty conversation")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str) or not isinstance(turn.get("from"), str):
            raise ConversationError(f"invalid json: turn {k} needs a string 'from' and a string 'value'")
        role = ROLE_NAMES.get(turn["from"])
        if role is None:
            raise ConversationError(f"invalid json: turn {k} has unknown role {turn.get('from')!r}")
        out.append({"role": role, "value": turn["value"]})
    if not any(t["role"] == "assistant" and t["value"].strip() for t in out):
        raise ConversationError("empty conversation: no assistant turn to learn from")
    return out


def attach_images(turns: list[dict[str, str]], n_images: int) -> list[dict[str, str]]:
    """Check <image> tags against the images; with no tags, images go before the first user turn's text."""
    tags = sum(t["value"].count(IMAGE_TAG) for t in turns)
    if tags == n_images:
        return turns
    if tags == 0:
        first_user = next((k for k, t in enumerate(turns) if t["role"] == "user"), None)
        if first_user is None:
            raise ConversationError("image tag mismatch: images but no user turn to attach them to")
        turns = [dict(t) for t in turns]
        turns[first_user]["value"] = (IMAGE_TAG + "\n") * n_images + turns[first_user]["value"]
        return turns
    raise ConversationError(f"image tag mismatch: {tags} <image> tags for {n_images} images")


def encode_conversation(turns: Sequence[dict[str, str]], image_tokens: Sequence[int], tokenizer: Tokenizer,
                        template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (int32) for one sample; `image_tokens[i]` = LLM tokens of the i-th image."""
    ids, labels, _ = encode_with_image_starts(turns, image_tokens, tokenizer, template)
    return ids, labels


def encode_with_image_starts(turns: Sequence[dict[str, str]], image_tokens: Sequence[int], tokenizer: Tokenizer,
                             template: ChatTemplate) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """encode_conversation, plus where each image's run of context tokens starts in the ids."""
    pieces: list[tuple[str | int, bool]] = []  # (text, or a special token's id; trained on)
    placeholders: dict[int, int] = {}  # piece index -> image number
    if template.system_prompt and not any(t["role"] == "system" for t in turns):
        turns = [{"role": "system", "value": template.system_prompt}, *turns]
    special = {name: tokenizer.token_to_id(name) for name in template.special_tokens}
    image_no = 0
    for turn in turns:
        learn = turn["role"] == "assistant"
        pieces += [(special[template.turn_start], False), (f"{turn['role']}\n", False)]
        chunks = turn["value"].split(IMAGE_TAG)
        for k, chunk in enumerate(chunks):
            if k > 0:
                placeholders[len(pieces)] = image_no
                pieces.append(("", False))
                image_no += 1
            if chunk:
                pieces.append((chunk, learn))
        pieces.append((special[template.turn_end], learn))
        pieces.append(("\n", False))

    texts = [piece for piece, _ in pieces if isinstance(piece, str)]
    encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
    start, end, context = (special[template.image_start], special[template.image_end],
                           special[template.image_context])
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    image_starts: list[int] = []
    length = 0
    for k, (piece, learn) in enumerate(pieces):
        if isinstance(piece, int):
            piece_ids = np.array([piece], dtype=np.int32)
        elif k in placeholders:
            next(encoded)
            n = image_tokens[placeholders[k]]
            piece_ids = np.concatenate([[start], np.full(n, context), [end]]).astype(np.int32)
            image_starts.append(length + 1)
        else:
            piece_ids = np.asarray(next(encoded).ids, dtype=np.int32)
        ids.append(piece_ids)
        labels.append(piece_ids if learn else np.full(len(piece_ids), IGNORE_INDEX, dtype=np.int32))
        length += len(piece_ids)
    return np.concatenate(ids), np.concatenate(labels), image_starts
