"""Loader cores and memory a dataset needs per GPU (`packfeed stats --gpus N --step-seconds S`): each sample's
preprocessing seconds in each pixel mode (its features, `packfeed.server.index.cpu_features`, times this
machine's calibration, `packfeed calibrate`), the samples a GPU takes per step in the balanced plan, and what a
worker holds while it prepares them.

cores per GPU = samples per GPU-step x mean seconds per sample / step seconds: the worker cores that keep each
GPU fed when preprocessing is spread evenly over them. Not counted: the server's main process (gRPC framing
and copies, a few ms a sample, BENCHMARKS "Loader cores per GPU"), which runs beside the workers.
memory per GPU = the tiles of (prefetch_steps + 1) rank-steps + decoding the largest image, per worker core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from packfeed.v1.options import PixelMode


def describe_ms(seconds: np.ndarray) -> dict[str, float]:
    if not len(seconds):
        return {}
    ms = seconds * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": round(float(ms.mean()), 3), "p50": round(float(p50), 3), "p90": round(float(p90), 3),
            "p99": round(float(p99), 3), "max": round(float(ms.max()), 3)}


def preprocessing_ms(index: str | Path, modes: list[PixelMode], measure: bool) -> dict[str, Any]:
    """Per mode, the distribution of the valid samples' predicted ms (by this machine's calibration: measured
    now where none is kept and `measure`, else the mode is left out)."""
    from packfeed.server.index.cpu_features import sample_features
    from packfeed.server.tools.calibrate import cost_model

    models = {mode: cost_model(mode, measure_if_missing=measure) for mode in modes}
    models = {mode: model for mode, model in models.items() if model is not None}
    out = {}
    for mode, features in (sample_features(index, list(models)) if models else {}).items():
        seconds = models[mode].seconds_of(features[features[:, 0] > 0])
        out[mode.value] = {"ms_per_sample": describe_ms(seconds), "seconds": seconds}
    return out


def loader_cores(index: str | Path, gpus: int, step_seconds: float, samples_per_gpu_step: float,
                 modes: list[PixelMode] = list(PixelMode)) -> dict[str, Any]:
    """The `loader_cores` section of a report: per pixel mode, ms per sample, cores and memory per GPU."""
    from packfeed.media.pixel_modes import PIXEL_PATHS
    from packfeed.server.index.table import read_index
    from packfeed.server.serve.config import ServerConfig
    from packfeed.server.tools.calibrate import calibration_path

    if gpus < 1 or step_seconds <= 0:
        raise ValueError("--gpus is at least 1 and --step-seconds above 0")
    table, _ = read_index(index, columns=["valid", "pixel_bytes", "image_widths", "image_heights", "image_sizes"])
    valid = table.column("valid").to_numpy(zero_copy_only=False).astype(bool)
    tiles = table.column("pixel_bytes").to_numpy(zero_copy_only=False)[valid].astype(np.float64)
    areas = [w * h for ws, hs in zip(*(table.column(c).to_pylist() for c in ("image_widths", "image_heights")))
             for w, h in zip(ws, hs)]
    files = table.column("image_sizes").to_pylist()
    file_bytes = np.array([sum(sizes) for sizes, ok in zip(files, valid) if ok], np.float64)
    prefetch = ServerConfig.__dataclass_fields__["prefetch_steps"].default
    by_mode, cores = {}, {}
    for mode, measured in preprocessing_ms(index, modes, measure=True).items():
        path = PIXEL_PATHS[PixelMode(mode)]
        per_sample = float(measured["seconds"].mean()) if len(measured["seconds"]) else 0.0
        cores[mode] = round(samples_per_gpu_step * per_sample / step_seconds, 3)
        held = (file_bytes if path.sends_files else tiles).mean() if len(tiles) else 0.0
        decoding = max(areas, default=0) * path.decode_bytes_per_pixel
        memory = (prefetch + 1) * samples_per_gpu_step * held + max(1.0, cores[mode]) * decoding
        by_mode[mode] = {"ms_per_sample": measured["ms_per_sample"], "cores_per_gpu": cores[mode],
                         "memory_per_gpu_mb": round(memory / 2**20, 1)}
    return {"gpus": gpus, "step_seconds": step_seconds, "samples_per_gpu_step": round(samples_per_gpu_step, 2),
            "calibration": str(calibration_path()), "by_pixels": by_mode, "cores_per_gpu": cores,
            "cores_total": {mode: round(c * gpus, 1) for mode, c in cores.items()}}
