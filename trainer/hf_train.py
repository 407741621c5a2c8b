"""Training a Hugging Face VLM on packs: `packfeed train model.hf=FAMILY` (with `parallel.pp=1`).

Read top to bottom: open this rank's stream -> build the family's `transformers` model sized from the dataset's
conventions (`packfeed.trainer.models.hf.build`) -> shard it with FSDP2 (`fully_shard`) over the DP ranks: every LLM
decoder layer, then the root (the vision tower stays in the root's group, so a rank whose packs hold no image
never leaves the others waiting in a collective) -> every step, each of the rank's M packs goes through
`packfeed.client.hf.to_hf_inputs(pack, family, dp)` and forward/backward (gradients accumulate; the loss is
normalised over the whole global step) -> clip, AdamW, log one line of metrics.

Checkpoints (`checkpoint.every`): the sharded model and optimizer with `torch.distributed.checkpoint`, each
rank's stream position, the LR schedule; a restarted run continues at exactly the next step.
"""

from __future__ import annotations

import collections
import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from packfeed.trainer import checkpoint
from packfeed.trainer.config import TrainConfig
from packfeed.trainer.data import job_conventions, open_stream
from packfeed.trainer.models.hf.build import attention_implementation, build_hf_model
from packfeed.trainer.parallel.mesh import Mesh, log
from packfeed.trainer.metrics import write_record


def language_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The LLM's decoder layers (they run for every pack, text-only ones included)."""
    for name, module in model.named_modules():
        if name.endswith("language_model") and isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return list(module.layers)
    raise ValueError(f"{type(model).__name__}: no language_model.layers to shard")


def shard(model: torch.nn.Module, mesh: Mesh, precision: str) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device_mesh = init_device_mesh(mesh.device.type, (mesh.dp,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for layer in language_layers(model):
        fully_shard(layer, mesh=device_mesh, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, mp_policy=policy)
    quiet_view_warning()
    return model


def output_views(output) -> list[str]:
    """Names of the grad-requiring tensors in a model's output that are views (FSDP2 warns about each)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import collect_grad_tensors

    return [name for name, value in output.items()
            if any(t._base is not None for t in collect_grad_tensors(value))]


def quiet_view_warning() -> None:
    """FSDP2 warns when a wrapped module returns a view: an in-place op on it would drop the pre-backward hook.
    The views the VLMs return are their per-image features in `image_outputs` (a split of the merged
    features), which this loop never touches: it reads `.loss` and never writes an output in place, and the hook
    on every other output (the loss included) still fires. Gradients equal a single process's (tests), so the
    warning is filtered, for this message only."""
    import warnings

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) returned "
                                              r"a view tensor")


class HFTrainer:
    """Owns the sharded model, the optimizer and the loop."""

    def __init__(self, config: TrainConfig, mesh: Mesh, stream, conventions):
        if config.parallel.pp != 1:
            raise ValueError("Hugging Face models train data-parallel with FSDP2: set parallel.pp=1")
        self.config, self.mesh, self.stream, self.conventions = config, mesh, stream, conventions
        self.family = config.model.hf
        self.layout = config.data.collate  # padded: HF's usual padded batches, masked by sdpa (the baseline)
        choice = "sdpa" if self.layout == "padded" else config.model.hf_attention
        implementation = attention_implementation(choice, mesh.device)
        self.attention = "sdpa" if implementation == "sdpa" else "varlen"  # the others read cu_seq_lens
        model = build_hf_model(self.family, conventions, dict(config.model.hf_config), attention=implementation,
                               seed=config.model.seed).to(mesh.device)
        self.model = shard(model, mesh, config.parallel.precision)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.optim.lr,
                                           weight_decay=config.optim.weight_decay)
        warmup = max(config.optim.warmup_steps, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.data_wait_s = 0.0

    def train_step(self, step) -> dict:
        from packfeed.client.hf import empty_hf_inputs, to_hf_inputs

        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, tokens, slots = 0.0, 0, 0
        if self.mesh.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.mesh.device)
        dtype = torch.bfloat16 if self.config.parallel.precision == "bf16" else torch.float32
        for pack in step.packs:
            if pack.empty:
                inputs = empty_hf_inputs(pack, self.mesh.dp, self.mesh.device)
            else:
                inputs = to_hf_inputs(pack, self.family, dp=self.mesh.dp, conventions=self.conventions,
                                      dtype=dtype, device=self.mesh.device, attention=self.attention,
                                      layout=self.layout)
                tokens += int(pack.input_ids.shape[0])
                slots += inputs["input_ids"].numel()  # a padded batch's rows x its longest sample
            loss = self.model(**inputs).loss
            loss.backward()
            loss_sum += float(loss.detach())
        clip = self.config.optim.clip_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.scheduler.step()
        peak = torch.cuda.max_memory_allocated(self.mesh.device) if self.mesh.device.type == "cuda" else 0
        return {"loss_sum": loss_sum, "tokens": tokens, "slots": slots, "seconds": time.perf_counter() - started,
                "grad_norm": float(norm), "peak_bytes": peak}

    def record(self, step, result: dict, wait: float) -> dict:
        """One metrics line: the global step's token-mean loss (each rank's loss is normalised by the step's
        tokens / dp, so the sum over ranks is dp times the mean), tokens, the slowest rank's time."""
        sums = torch.tensor([result["loss_sum"], result["tokens"], result["slots"]], dtype=torch.float64,
                            device=self.mesh.device)
        maxes = torch.tensor([result["seconds"], wait, result["peak_bytes"]], dtype=torch.float64,
                             device=self.mesh.device)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        loss, tokens, slots = sums.tolist()
        seconds, wait_s, peak = maxes.tolist()
        counts = [None] * dist.get_world_size()
        dist.all_gather_object(counts, dict(collections.Counter(step.sample_sources)))
        return {"epoch": step.epoch, "step": step.step, "loss": loss / self.mesh.dp, "step_s": seconds,
                "data_wait_s": wait_s, "tokens": int(tokens), "padded_tokens": int(slots),
                "pad_fraction": 1 - tokens / slots if slots else 0.0, "peak_memory_mib": peak / 2**20,
                "tokens_per_s": tokens / seconds if seconds else 0.0, "grad_norm": result["grad_norm"],
                "samples_by_dataset": dict(sum((collections.Counter(c) for c in counts), collections.Counter()))}

    def run(self, out: Path, steps_done: int) -> list[dict]:
        config, mesh = self.config, self.mesh
        history, limit, every = [], config.optim.steps or 1 << 62, config.checkpoint.every
        steps = iter(self.stream)
        with (out / "metrics.jsonl").open("a") if mesh.rank == 0 else contextlib.nullcontext() as metrics:
            while steps_done < limit:
                started = time.perf_counter()
                step = next(steps, None)
                wait = time.perf_counter() - started
                if not _everyone(step is not None, mesh):
                    break
                record = self.record(step, self.train_step(step), wait)
                history.append(record)
                steps_done += 1
                if every and steps_done % every == 0:
                    checkpoint.save_sharded(out / "checkpoints", steps_done, mesh, self.model, self.optimizer,
                                            self.scheduler, self.stream.state_dict(), {"hf": self.family},
                                            config.checkpoint.keep)
                write_record(metrics, record, len(history), config.log_every, mesh)
        return history


def _everyone(has_step: bool, mesh: Mesh) -> bool:
    """Whether every rank has a step (a stream that ended on one rank ends the run on all)."""
    flag = torch.tensor([1 if has_step else 0], device=mesh.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def train_hf(config: TrainConfig, mesh: Mesh, target: str, out: Path) -> dict:
    resume_from = checkpoint.latest(out / "checkpoints") if config.checkpoint.resume else None
    resumed = checkpoint.read_meta(resume_from) if resume_from else None
    stream = open_stream(config, mesh, target, resume_from)
    with contextlib.closing(stream):
        if resume_from:
            log(mesh, f"resuming from {resume_from} after {resumed['steps_done']} steps"
                + (" at another DP (elastic resume)" if stream.info.HasField("resume") else ""))
        conventions = job_conventions(stream, mesh)
        trainer = HFTrainer(config, mesh, stream, conventions)
        log(mesh, f"{config.model.hf}: {sum(p.numel() for p in trainer.model.parameters()):,} parameters, FSDP2 over "
            f"{mesh.dp} rank(s), vocabulary {conventions.vocab_size}, image policy {conventions.image_policy.name}")
        if resume_from:
            checkpoint.load_sharded(resume_from, trainer.model, trainer.optimizer, trainer.scheduler)
        history = trainer.run(out, resumed["steps_done"] if resumed else 0)
    summary = {"hf": config.model.hf, "steps": len(history), "final_loss": history[-1]["loss"] if history else None}
    return {"summary": summary, "history": history}
