"""Train a Hugging Face VLM with `transformers.Trainer` (or TRL's `SFTTrainer`, `--trl`) on a Packfeed job.

    packfeed demo --out demo-out --dataset-only --samples 64
    packfeed index 'demo-out/shards/*.tar' --tokenizer demo-out/tokenizer.json --preset qwen2_vl \\
        --extend-tokenizer --max-pixels 200704 --out qwen2_vl/index.parquet
    packfeed serve --index qwen2_vl/index.parquet --listen 127.0.0.1:50051 &
    torchrun --nproc-per-node 2 examples/hf_trainer.py 127.0.0.1:50051 trainer-out --steps 4
    torchrun --nproc-per-node 2 examples/hf_trainer.py 127.0.0.1:50051 trainer-out --steps 6 --resume

`--extend-tokenizer` writes the dataset's tokenizer (the demo's, with Qwen2-VL's special tokens) beside the index,
in qwen2_vl/; `--max-pixels 200704` keeps the demo photographs at most 256 LLM tokens an image, for a CPU. Against
a server started with a token (`PACKFEED_AUTH_TOKEN`), export the same variable for the trainers: the client
reads it. The model here is a small randomly initialised Qwen2-VL whose config `model_config` makes from the job's
conventions (vocabulary, placeholder ids, vision geometry), so the example runs on a CPU; for a real one, load it
with `from_pretrained` (its vocabulary and image token must be the dataset's: index with the model's preset and
tokenizer; PackfeedTrainer refuses a model that disagrees, naming the field).
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import Qwen2VLForConditionalGeneration, TrainerCallback

from packfeed.client import PackStream
from packfeed.client.model.hf import model_config
from packfeed.client.frameworks.hf_trainer import PackfeedTrainer, packfeed_training_arguments

SIZES = {"text": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}}


class StopAt(TrainerCallback):
    """Stop after `steps` optimizer steps, with the learning-rate schedule sized for the whole job (max_steps):
    a run stopped at 4 and resumed to 6 continues the one schedule, where max_steps=4 would decay it to 0 at
    step 4 and train step 5 at a learning rate of 0."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = control.should_training_stop or state.global_step >= self.steps
        control.should_save = control.should_save or control.should_training_stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the Packfeed server, host:port")
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps of the job (the "
                        "schedule is the whole job's, so a resumed run continues it; default: the whole job)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    parser.add_argument("--trl", action="store_true", help="TRL's SFTTrainer instead of transformers.Trainer")
    parser.add_argument("--deepspeed", metavar="CONFIG", help="a DeepSpeed config (examples/ds_zero3.json: ZeRO-3; "
                        "pip install packfeed[deepspeed])")
    parser.add_argument("--tokenizer", default="qwen2_vl/tokenizer.json", help="with --trl: the dataset's tokenizer")
    options = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    with PackStream(options.target, job="hf-trainer-example", rank=rank, dp=world, microbatches=2,
                    epochs=2) as stream:
        torch.manual_seed(0)  # a config matching the dataset (vocabulary, placeholders, vision geometry)
        model = Qwen2VLForConditionalGeneration(model_config("qwen2_vl", stream.conventions, **SIZES))
        settings = dict(output_dir=options.output_dir, learning_rate=1e-3, save_steps=2, logging_steps=1,
                        report_to=[], use_cpu=True)  # max_steps: the whole job (len(stream))
        if options.deepspeed:
            settings["deepspeed"] = options.deepspeed
        stop = [StopAt(options.steps)] if options.steps else []
        if options.trl:
            from transformers import PreTrainedTokenizerFast

            from packfeed.client.frameworks.sft_trainer import PackfeedSFTTrainer, packfeed_sft_config

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=options.tokenizer, pad_token="<|im_end|>")
            trainer = PackfeedSFTTrainer(model=model, args=packfeed_sft_config(stream, **settings), stream=stream,
                                         family="qwen2_vl", processing_class=tokenizer, callbacks=stop)
        else:
            trainer = PackfeedTrainer(model=model, args=packfeed_training_arguments(stream, **settings),
                                      stream=stream, family="qwen2_vl", callbacks=stop)
        trainer.train(resume_from_checkpoint=True if options.resume else None)
    # the ranks leave together, the process group torn down: a rank whose interpreter exits while gloo's threads
    # still serve the other can abort at teardown ("terminate called without an active exception")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
