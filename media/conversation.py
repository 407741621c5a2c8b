"""A sample's conversation: its JSON member parsed, its turns checked, its <image> and <video> tags matched to its
images and videos. Each failure is a ConversationError whose message is the reason the index records."""

from __future__ import annotations

import json
from typing import Any

IMAGE_TAG = "<image>"  # the image placeholder of LLaVA/InternVL annotations (the converters write it too)
VIDEO_TAG = "<video>"  # a video's place in a turn (InternVL and LLaVA-Video annotations)
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class ConversationError(ValueError):
    """A sample's conversation cannot be used; the message is the reason recorded in the index."""


def parse_json(raw: bytes) -> Any:
    """A sample's JSON member, or raise ConversationError with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConversationError(f"bad utf-8 in json: byte {error.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConversationError(f"invalid json: {error.msg} at line {error.lineno} column {error.colno}") from None
    except RecursionError:
        raise ConversationError("invalid json: nested too deeply") from None


def parse_conversation(raw: bytes) -> list[dict[str, str]]:
    """Decode a sample's JSON member into a list of turns, or raise ConversationError with the reason."""
    doc = parse_json(raw)
    return conversation_turns(doc.get("conversations") if isinstance(doc, dict) else None)


def conversation_turns(turns: Any) -> list[dict[str, str]]:
    """LLaVA-style `conversations` ([{"from": "human", "value": ...}, ...]) as [{"role", "value"}], or raise
    ConversationError with what is wrong with their shape."""
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


def attach_images(turns: list[dict[str, str]], n_images: int, n_videos: int = 0) -> list[dict[str, str]]:
    """Check <image> and <video> tags against the images and videos; a kind with no tags goes before the first
    user turn's text (images first)."""
    missing = ""
    for tag, count in ((IMAGE_TAG, n_images), (VIDEO_TAG, n_videos)):
        tags = sum(t["value"].count(tag) for t in turns)
        if tags == count:
            continue
        if tags:
            kind = "image" if tag == IMAGE_TAG else "video"
            raise ConversationError(f"{kind} tag mismatch: {tags} {tag} tags for {count} {kind}s")
        missing += (tag + "\n") * count
    if not missing:
        return turns
    first_user = next((k for k, t in enumerate(turns) if t["role"] == "user"), None)
    if first_user is None:
        raise ConversationError("image tag mismatch: images or videos but no user turn to attach them to")
    turns = [dict(t) for t in turns]
    turns[first_user]["value"] = missing + turns[first_user]["value"]
    return turns
