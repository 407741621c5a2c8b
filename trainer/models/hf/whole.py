"""A `transformers` VLM run whole, as its library runs it, one pack at a time (`packfeed train model.hf=FAMILY`
at parallel.pp=1; `packfeed.trainer.parallel.whole` shards it over the DP ranks): the model, the layers it is
sharded by, and each pack's inputs through `packfeed.client.model.hf.to_hf_inputs`."""

from __future__ import annotations

from typing import Any

import torch

from packfeed.client.model.attention import VARLEN_ATTENTION
from packfeed.trainer.models.hf.build import attention_implementation, build_hf_model


def language_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The LLM's decoder layers (they run for every pack, text-only ones included)."""
    for name, module in model.named_modules():
        if name.endswith("language_model") and isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return list(module.layers)
    raise ValueError(f"{type(model).__name__}: no language_model.layers to shard")


def output_views(output) -> list[str]:
    """Names of the grad-requiring tensors in a model's output that are views (FSDP2 warns about each)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import collect_grad_tensors

    return [name for name, value in output.items()
            if any(t._base is not None for t in collect_grad_tensors(value))]


def quiet_view_warning() -> None:
    """FSDP2 warns when a wrapped module returns a view: an in-place op on it would drop the pre-backward hook.
    The views the VLMs return are their per-image features in `image_outputs` (a split of the merged
    features), which the trainer never touches: it reads `.loss` and never writes an output in place, and the
    hook on every other output (the loss included) still fires. Gradients equal a single process's (tests), so
    the warning is filtered, for this message only."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) returned "
                                              r"a view tensor")


class HFWholeModel:
    """The family's model sized for the dataset (`model`: the trainer's model section). `collate=padded` feeds
    each pack's samples as HF's usual padded batch, masked by sdpa: the baseline packing is measured against."""

    def __init__(self, model_config, conventions: Any, collate: str, precision: str, device: torch.device):
        self.family, self.conventions, self.layout = model_config.hf, conventions, collate
        choice = "sdpa" if collate == "padded" else model_config.hf_attention
        implementation = attention_implementation(choice, device)
        self.attention = "sdpa" if implementation == "sdpa" else "varlen"  # the others read cu_seq_lens
        # a group's prompt computed once where the attention can keep its responses apart: sdpa with the mask
        # to_hf_inputs builds, or Packfeed's kernel reading the segments (HF's flash-attention 2 cannot)
        self.shared_prefix = collate == "packed" and implementation in ("sdpa", VARLEN_ATTENTION)
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.module = build_hf_model(self.family, conventions, model_config.hf_sizes, attention=implementation,
                                     seed=model_config.seed).to(device)
        self.meta = {"hf": self.family}
        quiet_view_warning()

    def describe(self) -> str:
        return (f"{self.family}: {sum(p.numel() for p in self.module.parameters()):,} parameters, vocabulary "
                f"{self.conventions.vocab_size}, image policy {self.conventions.image_policy.name}")

    def units(self) -> list[torch.nn.Module]:
        return language_layers(self.module)

    def pack_inputs(self, pack, dp: int, device: torch.device) -> tuple[dict, int, int]:
        from packfeed.client.model.hf import to_hf_inputs

        inputs = to_hf_inputs(pack, self.family, dp=dp, conventions=self.conventions, dtype=self.dtype,
                              device=device, attention=self.attention, layout=self.layout,
                              shared_prefix=self.shared_prefix)
        if pack.empty:  # a step's last microbatch may hold nothing: it still runs every collective
            return inputs, 0, 0
        # slots: a padded batch's rows x its longest sample
        return inputs, int(pack.input_ids.shape[0]), inputs["input_ids"].numel()
