"""Conversation -> token ids and labels: the one chat-template implementation the index and the server share.

The index records `len(input_ids)` of exactly what the server will later produce for the same sample,
so planned pack lengths are the lengths that reach the trainer.

A sample renders as ``bos`` then, per turn, ``{role}_prefix`` + content + ``{role}_suffix`` + ``separator``.
Each ``<image>`` tag in a turn becomes ``image_start`` + ``image_context`` x (that image's LLM tokens) +
``image_end``; LLaVA's bare run leaves start and end empty. Each ``<video>`` tag becomes, with a
``video_context`` token (Qwen-VL), ``image_start`` + ``video_context`` x (the video's LLM tokens) + ``image_end``;
without one (InternVL), its frames as images, each after ``frame_prompt`` (numbered from 1), joined by newlines:
``Frame1: <img>...</img>\nFrame2: <img>...</img>``, as the Hugging Face InternVL processor writes them. With
``video_timestamps`` (Qwen3-VL), each temporal patch is a run of its own after its time: ``<0.5 seconds>`` +
``image_start`` + ``video_context`` x n + ``image_end`` per patch, as the reference Qwen3-VL processor (and
`transformers` >= 5.25) writes it; ``wrap_video`` adds the outer ``image_start`` ... ``image_end`` that
`transformers` 5.19-5.24 left around them. Labels are -100 everywhere except the content and
``assistant_suffix`` of assistant turns. Presets (`PRESETS`) give InternVL's ChatML, Qwen2-VL, LLaVA-1.5
(Vicuna v1) and Llama-3; every field can be set on its own.

Special tokens: in the markers (bos, prefixes, suffixes, separator) every ``<...>`` without spaces is one
special token, and so are the three image strings. They are placed by id, never parsed out of text, and the
tokenizer must know every one of them: `load_tokenizer` refuses a tokenizer that lacks any (naming them) rather
than adding them in memory, where the trainer's tokenizer would never see them; `extend_tokenizer` writes a
tokenizer.json that has them, for `packfeed index --extend-tokenizer`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from packfeed.media.conversation import IMAGE_TAG, VIDEO_TAG

if TYPE_CHECKING:  # imported where used: the CLI's parser reads the presets without loading tokenizers
    from tokenizers import Tokenizer

IGNORE_INDEX = -100
_VISUAL_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")
_SPECIAL_IN_MARKER = re.compile(r"(<[^<>\s]+>)")
MARKERS = ("bos", "system_prefix", "system_suffix", "user_prefix", "user_suffix", "assistant_prefix",
           "assistant_suffix", "separator")


class MissingTokensError(ValueError):
    """The tokenizer lacks special tokens the chat template places."""


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ChatTemplate:
    """How turns and images become text; the defaults are InternVL-Chat's ChatML (preset `internvl`)."""

    bos: str = field(default="", metadata=_help("token at the start of every sample, e.g. <s> (default: none)"))
    system_prefix: str = field(default="<|im_start|>system\n", metadata=_help("text before a system turn"))
    system_suffix: str = field(default="<|im_end|>", metadata=_help("text after a system turn"))
    user_prefix: str = field(default="<|im_start|>user\n", metadata=_help("text before a user turn"))
    user_suffix: str = field(default="<|im_end|>", metadata=_help("text after a user turn"))
    assistant_prefix: str = field(default="<|im_start|>assistant\n", metadata=_help("text before an assistant turn"))
    assistant_suffix: str = field(default="<|im_end|>",
                                  metadata=_help("text after an assistant turn; trained on, like the turn"))
    separator: str = field(default="\n", metadata=_help("text after every turn's suffix, not trained on"))
    image_start: str = field(default="<img>", metadata=_help("token before an image's placeholders (may be empty)"))
    image_end: str = field(default="</img>", metadata=_help("token after an image's placeholders (may be empty)"))
    image_context: str = field(default="<IMG_CONTEXT>",
                               metadata=_help("the placeholder token vision features replace, once per LLM token"))
    system_prompt: str | None = field(default=None,
                                      metadata=_help("system turn prepended to conversations that have none"))
    video_context: str = field(default="", metadata=_help(
        "the placeholder token video features replace (Qwen-VL: <|video_pad|>); empty: a video's frames are images"))
    frame_prompt: str = field(default="Frame{}: ", metadata=_help(
        "text before each frame of a video whose frames are images; {} is the frame's number from 1"))
    video_timestamps: str = field(default="", metadata=_help(
        "text before each temporal patch of a video, formatted with its time in seconds, e.g. <{:.1f} seconds> "
        "(Qwen3-VL); empty: one run of video_context tokens"))
    wrap_video: bool = field(default=False, metadata=_help(
        "with video_timestamps, also put image_start and image_end around a video's whole run of patches, as "
        "transformers 5.19-5.24's Qwen3-VL processor wrote it (the reference Qwen3-VL and transformers >= 5.25 "
        "do not)"))

    def __post_init__(self):
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "wrap_video":
                if not isinstance(value, bool):
                    raise ValueError(f"chat template field wrap_video must be true or false, not {value!r}")
            elif not (isinstance(value, str) or (value is None and spec.name == "system_prompt")):
                raise ValueError(f"chat template field {spec.name} must be a string, not {value!r}")
        if not self.image_context:
            raise ValueError("chat template needs an image_context token (the placeholder vision features replace)")
        if self.system_prompt and IMAGE_TAG in self.system_prompt:
            raise ValueError(f"the system prompt cannot hold {IMAGE_TAG}: image tags take the sample's images")
        if self.frame_prompt.count("{}") > 1 or re.search(r"\{(?!\})|(?<!\{)\}", self.frame_prompt):
            raise ValueError(f"chat template frame_prompt {self.frame_prompt!r}: at most one {{}} (the frame number) "
                             f"and no other braces")
        if self.video_timestamps:
            try:
                self.video_timestamps.format(1.25)
            except (IndexError, KeyError, ValueError) as error:
                raise ValueError(f"chat template video_timestamps {self.video_timestamps!r} must format one number "
                                 f"(the seconds), e.g. <{{:.1f}} seconds>: {error}") from None
            if not self.video_context:
                raise ValueError("chat template video_timestamps needs a video_context token")
        for name in ("bos", "image_start", "image_end", "image_context", "video_context"):
            value = getattr(self, name)
            if value and not _SPECIAL_IN_MARKER.fullmatch(value):
                raise ValueError(f"chat template {name} {value!r} must be one special token written <...> "
                                 f"(no spaces)")

    @property
    def special_tokens(self) -> list[str]:
        """Every token the template places by id, in a fixed order (the order `extend_tokenizer` appends)."""
        found = [token for name in MARKERS for token in _SPECIAL_IN_MARKER.findall(getattr(self, name))]
        found += [self.image_start, self.image_end, self.image_context, self.video_context]
        return list(dict.fromkeys(token for token in found if token))

    def to_dict(self) -> dict[str, Any]:
        """Every field, but wrap_video only where it means something (with video_timestamps): the templates of
        indexes without timestamps record, and so fingerprint, as they did before the field existed."""
        recorded = asdict(self)
        if not self.video_timestamps:
            del recorded["wrap_video"]
        return recorded

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "ChatTemplate":
        """The template an index records, or a config file's `chat_template:` section, which may name a
        `preset` and override any field. Indexes written before per-role markers recorded `turn_start` and
        `turn_end` (ChatML); they read back as the same template. Indexes written before `wrap_video` rendered a
        timestamped video wrapped; they read back so, their recorded lengths intact."""
        raw = dict(raw or {})
        preset = raw.pop("preset", None)
        if "turn_start" in raw or "turn_end" in raw:
            start, end = raw.pop("turn_start", "<|im_start|>"), raw.pop("turn_end", "<|im_end|>")
            raw = {**{f"{role}_prefix": f"{start}{role}\n" for role in ("system", "user", "assistant")},
                   **{f"{role}_suffix": end for role in ("system", "user", "assistant")}, **raw}
        known = {spec.name for spec in fields(cls)}
        if raw.get("video_timestamps") and "wrap_video" not in raw and known - {"wrap_video"} <= set(raw):
            raw["wrap_video"] = True  # recorded whole (as to_dict writes it) before the field existed
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown chat template field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown chat template preset {preset!r}; choose one of {', '.join(PRESETS)}")
        return replace(PRESETS[preset] if preset else cls(), **raw)


_VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
                  "helpful, detailed, and polite answers to the human's questions.")
_LLAMA3_HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"

PRESETS: dict[str, ChatTemplate] = {
    "internvl": ChatTemplate(),  # InternVL-Chat with InternLM2 / Qwen2 LLMs: ChatML, <img><IMG_CONTEXT>...</img>
    "qwen2vl": ChatTemplate(image_start="<|vision_start|>", image_end="<|vision_end|>", image_context="<|image_pad|>",
                            video_context="<|video_pad|>", system_prompt="You are a helpful assistant."),
    "llava": ChatTemplate(  # LLaVA-1.5 (Vicuna v1): bare run of <image> tokens, as the llava-hf processors expand
        bos="<s>", system_prefix="", system_suffix=" ", user_prefix="USER: ", user_suffix=" ",
        assistant_prefix="ASSISTANT: ", assistant_suffix="</s>", separator="", image_start="", image_end="",
        image_context="<image>", system_prompt=_VICUNA_SYSTEM),
    "llama3": ChatTemplate(  # Llama-3 headers (LLaVA-NeXT / LLaMA-3 recipes): bare <image> run
        bos="<|begin_of_text|>", system_prefix=_LLAMA3_HEADER.format("system"), system_suffix="<|eot_id|>",
        user_prefix=_LLAMA3_HEADER.format("user"), user_suffix="<|eot_id|>",
        assistant_prefix=_LLAMA3_HEADER.format("assistant"), assistant_suffix="<|eot_id|>", separator="",
        image_start="", image_end="", image_context="<image>"),
}


def missing_tokens(tokenizer: Tokenizer, template: ChatTemplate) -> list[str]:
    return [token for token in template.special_tokens if tokenizer.token_to_id(token) is None]


def check_tokens(tokenizer: Tokenizer, template: ChatTemplate, path: str | Path) -> None:
    """Raise MissingTokensError naming the special tokens of the template the tokenizer lacks, if any."""
    missing = missing_tokens(tokenizer, template)
    if missing:
        raise MissingTokensError(
            f"tokenizer {path} lacks the special token(s) {', '.join(missing)} that the chat template places "
            f"(its image placeholder is {template.image_context!r}); pick the template of the tokenizer's model "
            f"(--chat-template {' | '.join(PRESETS)}, or the marker and image token flags), or index with "
            f"--extend-tokenizer to write a tokenizer.json that has them beside the index (the trainer then "
            f"uses that one)")


def load_tokenizer(path: str | Path, template: ChatTemplate) -> Tokenizer:
    """Any HF `tokenizers` tokenizer.json that knows every special token of the template.

    Text is encoded with special tokens read as plain text: a sample that writes `<IMG_CONTEXT>` or `<|im_end|>`
    gets the ids of those characters, never the template's ids, which only the template itself places.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    check_tokens(tokenizer, template, path)
    tokenizer.encode_special_tokens = True
    return tokenizer


def extend_tokenizer(path: str | Path, template: ChatTemplate, out: str | Path) -> list[str]:
    """Write `out`: the tokenizer at `path` plus the template's missing special tokens (appended in a fixed
    order, so the same inputs give the same ids). Returns the tokens added."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    missing = missing_tokens(tokenizer, template)
    tokenizer.add_special_tokens(missing)
    tokenizer.save(str(out))
    return missing


class ChatEncoder:
    """A tokenizer and a template, with every marker's ids computed once."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate):
        self.tokenizer, self.template = tokenizer, template
        self.markers = {name: self._marker_ids(getattr(template, name)) for name in MARKERS}
        self.image_start = self._marker_ids(template.image_start)
        self.image_end = self._marker_ids(template.image_end)
        self.image_context = tokenizer.token_to_id(template.image_context)
        self.video_context = tokenizer.token_to_id(template.video_context) if template.video_context else None

    def _marker_ids(self, text: str) -> np.ndarray:
        ids: list[int] = []
        for k, piece in enumerate(_SPECIAL_IN_MARKER.split(text)):
            if k % 2:  # a special token, placed by id
                ids.append(self.tokenizer.token_to_id(piece))
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def encode(self, turns: Sequence[dict[str, str]], image_tokens: Sequence[int],
               video_tokens: Sequence[Sequence[int]] = (), video_times: Sequence[Sequence[float]] = (),
               turn_ends: list[int] | None = None) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Token ids and labels (int32) for one sample, and where each visual item's run of placeholder tokens
        starts in the ids, in the order they occur (`visual_items` says which items those are).
        `image_tokens[i]`: LLM tokens of the i-th image; `video_tokens[j]`: of each of the j-th video's items (one
        with a `video_context` token, one per temporal patch with `video_timestamps`, whose seconds
        `video_times[j]` gives, one per frame otherwise). `turn_ends`, when given, gets each of `turns`' end in
        the ids (after its separator; a system prompt the template adds counts in the first turn). Each turn's
        ids depend on that turn alone, so two samples whose first k turns are equal share their first
        `turn_ends[k - 1]` ids."""
        template, markers = self.template, self.markers
        added = 0
        if template.system_prompt and not any(t["role"] == "system" for t in turns):
            turns, added = [{"role": "system", "value": template.system_prompt}, *turns], 1
        # (ids, text, or a (placeholder id, count) run; learn)
        pieces: list[tuple[np.ndarray | str | tuple[int, int], bool]] = [(markers["bos"], False)]
        ends: list[int] = []  # per turn, the pieces up to its end
        images, videos, times = iter(image_tokens), iter(video_tokens), iter(video_times)
        for turn in turns:
            role, learn = turn["role"], turn["role"] == "assistant"
            pieces.append((markers[f"{role}_prefix"], False))
            for chunk in _VISUAL_TAGS.split(turn["value"]):
                if chunk == IMAGE_TAG:
                    pieces.append(((self.image_context, next(images)), False))
                elif chunk == VIDEO_TAG:
                    pieces += self._video_pieces(next(videos), next(times, ()))
                elif chunk:
                    pieces.append((chunk, learn))
            pieces += [(markers[f"{role}_suffix"], learn), (markers["separator"], False)]
            ends.append(len(pieces))

        encoded = iter(self.tokenizer.encode_batch([p for p, _ in pieces if isinstance(p, str)],
                                                   add_special_tokens=False))
        ids: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        starts: list[int] = []
        length = 0
        lengths: list[int] = []  # ids before each piece
        for piece, learn in pieces:
            lengths.append(length)
            if isinstance(piece, np.ndarray):
                piece_ids = piece
            elif isinstance(piece, tuple):
                starts.append(length + len(self.image_start))
                context = np.full(piece[1], piece[0], dtype=np.int32)
                piece_ids = np.concatenate([self.image_start, context, self.image_end])
            else:
                piece_ids = np.asarray(next(encoded).ids, dtype=np.int32)
            ids.append(piece_ids)
            labels.append(piece_ids if learn else np.full(len(piece_ids), IGNORE_INDEX, dtype=np.int32))
            length += len(piece_ids)
        if turn_ends is not None:
            lengths.append(length)
            turn_ends += [lengths[end] for end in ends[added:]]
        return np.concatenate(ids).astype(np.int32), np.concatenate(labels).astype(np.int32), starts

    def _video_pieces(self, items: Sequence[int],
                      times: Sequence[float]) -> list[tuple[np.ndarray | str | tuple[int, int], bool]]:
        if self.template.video_timestamps:
            if len(times) != len(items):
                raise ValueError(f"a video of {len(items)} temporal patches needs as many times, not {len(times)}")
            wrap = self.template.wrap_video
            pieces: list[tuple[np.ndarray | str | tuple[int, int], bool]] = [(self.image_start, False)] * wrap
            for tokens, seconds in zip(items, times):
                pieces += [(self.template.video_timestamps.format(seconds), False),
                           ((self.video_context, tokens), False)]
            return pieces + [(self.image_end, False)] * wrap
        if self.video_context is not None:
            return [((self.video_context, sum(items)), False)]
        pieces = []
        for number, tokens in enumerate(items, 1):
            prompt = ("\n" if number > 1 else "") + self.template.frame_prompt.replace("{}", str(number))
            if prompt:
                pieces.append((prompt, False))
            pieces.append(((self.image_context, tokens), False))
        return pieces


def visual_items(turns: Sequence[dict[str, str]], video_items: Sequence[int]) -> list[tuple[str, int]]:
    """The visual items of a sample in the order their placeholder runs occur: ("image", i) for its i-th image,
    ("video", j) once per item of its j-th video (`video_items[j]` of them: 1, or its frames)."""
    order: list[tuple[str, int]] = []
    image_no = video_no = 0
    for turn in turns:
        for tag in _VISUAL_TAGS.findall(turn["value"]):
            if tag == IMAGE_TAG:
                order.append(("image", image_no))
                image_no += 1
            else:
                order += [("video", video_no)] * video_items[video_no]
                video_no += 1
    return order


@lru_cache(maxsize=8)
def cached_encoder(path: str, template: ChatTemplate) -> ChatEncoder:
    return ChatEncoder(load_tokenizer(path, template), template)


def encode_conversation(turns: Sequence[dict[str, str]], image_tokens: Sequence[int], tokenizer: Tokenizer,
                        template: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (int32) for one sample; `image_tokens[i]` = LLM tokens of the i-th image."""
    ids, labels, _ = ChatEncoder(tokenizer, template).encode(turns, image_tokens)
    return ids, labels
