"""The prompt a group's samples share (GRPO's responses to one question, a preference pair): every token before
the sample's first loss token, with every image of the sample in it, before its last token (a response follows a
copy of that token, `packfeed.client.model.shared_prefix`). The index reads it from a sample's conversation, a live job
from what its producer put; both name it the same way, so samples with the same prompt are one group."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def shared_prompt(tokens: np.ndarray, learned: np.ndarray, images_end: int, image_checksums: Sequence[int],
                  more: bytes = b"") -> tuple[int, str] | None:
    """(the prompt's tokens, its key: a digest of those tokens, the images' checksums and `more`), or None where
    the sample shares no prompt (fewer than 2 tokens, or an image ending past its prompt's last token but one).
    `learned`: per token, whether it is in the loss; `images_end`: where its last image placeholder run ends."""
    prefix = int(np.argmax(learned)) if learned.any() else len(tokens)
    if prefix < 2 or images_end > prefix - 1:
        return None
    digest = xxhash.xxh3_128(np.ascontiguousarray(tokens[:prefix], dtype="<i4").tobytes())
    digest.update(np.asarray(image_checksums, dtype="<u8").tobytes())
    digest.update(more)
    return prefix, digest.hexdigest()
