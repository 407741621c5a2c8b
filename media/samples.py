"""Why a sample is left out, in words that read the same everywhere, and the one look at an image every stage
takes before trusting it: its upright size from the header, checked against the policy's pixel limit before
anything is decoded."""

from __future__ import annotations

import io
import re
import warnings

from PIL import Image, UnidentifiedImageError

from packfeed.media.image_policy import ImagePolicy, TooManyPixels
from packfeed.media.pixels import oriented_size


class SampleError(ValueError):
    """A sample that cannot be used, with the reason (an index row's `reason`, a conversion's rejection)."""


def image_size(data: bytes, verify: str, policy: ImagePolicy | None = None) -> tuple[int, int]:
    """(width, height) upright (EXIF orientation applied) from the header; with verify='decode' also decodes
    (JPEG at 1/8 scale: every byte of its data is still read), with 'full' decodes it whole, unless the `policy`'s
    pixel limit refuses the image first."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = oriented_size(image, data)  # a PNG is not decoded to look for its EXIF
                if policy is not None:
                    policy.check_pixels(width, height)  # before decoding: verifying it would cost its memory
                if verify in ("decode", "full"):
                    if image.format == "JPEG" and verify == "decode":
                        image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                    image.load()
    except UnidentifiedImageError:
        raise SampleError("not an image") from None
    except TooManyPixels as error:
        raise SampleError(f"image rejected by policy: {error}") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        if policy is not None:  # Pillow's limit is lifted to the largest policy's: this is that policy's refusal
            raise SampleError(f"image rejected by policy: over max_image_pixels {policy.max_image_pixels:,} "
                              f"({describe_error(error)})") from None
        raise SampleError(f"undecodable image: too many pixels ({describe_error(error)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise SampleError(f"undecodable image: {describe_error(error)}") from None
    if width < 1 or height < 1:
        raise SampleError(f"undecodable image: size {width}x{height}")
    return width, height


def describe_error(error: BaseException) -> str:
    """An exception's message as a reason: without object addresses ('<_io.BytesIO object at 0x7f...>'), so it
    reads the same on every server and in every run (reasons travel inside packs and into the index)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(error)) or type(error).__name__


def reason_category(reason: str) -> str:
    """'undecodable image: broken data stream' -> 'undecodable image' (what reports and metrics group by)."""
    return reason.split(":", 1)[0]


# What a server's skips are counted by (the `reason` label of packfeed_skipped_samples_total): a fixed set, so
# the metric's series never grow with the data. Every reason a server gives starts with one of these.
SERVE_SKIP_CATEGORIES = ("invalid in the index", "shard unreadable", "shard changed", "undecodable image",
                         "undecodable video", "over the memory budget", "token count differs", "video not servable")


def skip_metric_label(reason: str) -> str:
    """The fixed category of a server's skip reason ("other" for one outside SERVE_SKIP_CATEGORIES)."""
    return next((category for category in SERVE_SKIP_CATEGORIES if reason.startswith(category)), "other")

