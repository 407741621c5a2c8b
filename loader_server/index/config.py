"""How `packfeed index` costs samples: the tokenizer, chat template, image and video policies, verification and
the per-sample limits, one frozen `IndexConfig` made from flags or a conventions file and recorded in the index
(its fingerprint dict)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packfeed.media.chat import ChatTemplate, check_tokens, extend_tokenizer, missing_tokens
from packfeed.media.image_policy import DEFAULT_POLICY, VERIFY_MODES, ImagePolicy, policy_from_dict
from packfeed.media.video import VideoSampling

DEFAULT_MAX_SAMPLE_TOKENS = 262_144  # the longest contexts trained today, with room for long videos


@dataclass(frozen=True)
class IndexConfig:
    tokenizer: str
    image_policy: dict[str, Any] = field(default_factory=lambda: {"name": DEFAULT_POLICY})
    chat_template: dict[str, Any] = field(default_factory=lambda: ChatTemplate().to_dict())
    video_policy: dict[str, Any] = field(default_factory=lambda: VideoSampling().to_dict())
    # decode: decode every image (JPEG at 1/8 scale, which still reads every byte) to catch truncated or
    # corrupt data; header: trust the header, several times faster.
    verify_images: str = "decode"
    # When the tokenizer lacks the template's special tokens: refuse (False) or write an extended tokenizer.json
    # beside the index and record it (True).
    extend_tokenizer: bool = False
    # A sample of more LLM tokens (text and placeholders) is invalid: it could never train, and would be
    # tokenised again each time it is served.
    max_sample_tokens: int = DEFAULT_MAX_SAMPLE_TOKENS

    def __post_init__(self):
        if self.verify_images not in VERIFY_MODES:
            raise ValueError(f"verify_images must be one of {VERIFY_MODES}")
        if not Path(self.tokenizer).is_file():
            raise FileNotFoundError(f"tokenizer {self.tokenizer!r} not found: pass a HF tokenizer.json with --tokenizer")
        if isinstance(self.max_sample_tokens, bool) or not isinstance(self.max_sample_tokens, int) \
                or self.max_sample_tokens < 1:
            raise ValueError(f"max_sample_tokens must be a whole number >= 1, not {self.max_sample_tokens!r}")
        # the pixel limit recorded even when left at its default, so the index says which limit it applied
        policy = policy_from_dict(self.image_policy)  # fails early on a bad policy
        object.__setattr__(self, "image_policy", {**self.image_policy, "max_image_pixels": policy.max_image_pixels})
        # recorded whole (every field, defaults filled in), whatever subset was given
        object.__setattr__(self, "video_policy", VideoSampling.from_dict(self.video_policy).to_dict())
        if self.template.video_timestamps and self.video_sampling.is_random:
            raise ValueError("a chat template with video_timestamps writes each temporal patch's time into the text, "
                             "so its frames must be known when indexing: use --frame-sampling uniform, linspace or "
                             "segment, not random")

    # Built once per config, not once per sample (costing reads both for every row).
    @functools.cached_property
    def policy(self) -> ImagePolicy:
        return policy_from_dict(self.image_policy)

    @functools.cached_property
    def video_sampling(self) -> VideoSampling:
        return VideoSampling.from_dict(self.video_policy)

    @functools.cached_property
    def template(self) -> ChatTemplate:
        return ChatTemplate.from_dict(self.chat_template)

    def tokenizer_digest(self) -> str:
        return hashlib.sha256(Path(self.tokenizer).read_bytes()).hexdigest()[:16]

    def to_fingerprint_dict(self) -> dict[str, Any]:
        return {"image_policy": self.image_policy, "chat_template": self.chat_template, "video_policy": self.video_policy,
                "tokenizer": self.tokenizer_digest(), "verify_images": self.verify_images,
                "max_sample_tokens": self.max_sample_tokens}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "IndexConfig":
        from packfeed.server.index.conventions import conventions_of, video_policy_of

        if not args.tokenizer:
            raise ValueError("indexing shards needs --tokenizer TOKENIZER.json (the tokenizer the trainer uses)")
        policy, template = conventions_of(args)
        return cls(args.tokenizer, policy, template, video_policy_of(args), args.verify_images, args.extend_tokenizer,
                   **({"max_sample_tokens": args.max_sample_tokens} if args.max_sample_tokens is not None else {}))

    def with_tokenizer_for(self, out: str | Path) -> tuple["IndexConfig", dict[str, Any]]:
        """This config with a tokenizer that knows every special token of the template, and the index's record
        of it. Missing tokens are an error, unless `extend_tokenizer`: then a tokenizer.json with them appended
        is written beside the index, and the index records it (and the one it extends)."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(self.tokenizer)
        if not missing_tokens(tokenizer, self.template):
            return self, {"path": str(Path(self.tokenizer).resolve()), "sha256": self.tokenizer_digest()}
        if not self.extend_tokenizer:
            check_tokens(tokenizer, self.template, self.tokenizer)
        extended = (Path(out).parent / "tokenizer.json").resolve()
        if extended == Path(self.tokenizer).resolve():
            raise ValueError(f"--extend-tokenizer would overwrite the tokenizer {self.tokenizer}; write the index "
                             f"to another folder")
        original = {"path": str(Path(self.tokenizer).resolve()), "sha256": self.tokenizer_digest()}
        extended.parent.mkdir(parents=True, exist_ok=True)
        added = extend_tokenizer(self.tokenizer, self.template, extended)
        config = dataclasses.replace(self, tokenizer=str(extended))
        return config, {"path": str(extended), "sha256": config.tokenizer_digest(), "extended_from": original,
                        "added_tokens": added}
