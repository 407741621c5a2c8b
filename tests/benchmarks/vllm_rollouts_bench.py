"""Run inside vLLM's own environment (tests/vllm_env.py; tests/benchmarks/test_bench_vllm_rollouts.py runs it):
rollouts of one tiny Qwen2-VL on the same prompts (a Packfeed prompt job, images included) and machine, by HF
`generate` (as TRL's own generation runs it: the step's prompts in one left-padded batch, G sequences each,
sampling), by vLLM in this process through `VLLMEngine` (each image embedded from the loader server's pixel
values) and by a vLLM server on loopback through `VLLMServerEngine` (the pixel values over HTTP; tests/vllm_serve.py
starts it), rounds alternating. Prints one JSON line per round and method: seconds, CPU seconds (this process's;
for the server, this process's and the server's processes' together), completions.

Then the host memory one prompt's images cost, at Qwen2-VL's own image policy on a real 448 x 448 photograph:
shared (the loader server's pixel values, which the trainer reads, and the embeddings the engine takes of them)
against each keeping its own (the trainer's pixel values, and the engine's own preprocessing of the raw image:
the decoded image and its pixel values from the model's processor, as vLLM makes them).

    python tests/benchmarks/vllm_rollouts_bench.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import vllm_rollouts_check as check  # noqa: E402

G, NEW, ROUNDS, PROMPTS = 4, 32, 5, 12
check.TEXT.update(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def hf_rollouts(model, prompts, seed: int) -> int:
    """The step's prompts in one left-padded batch, G sampled sequences each (num_return_sequences)."""
    width = max(len(p.ids) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask, types = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt.ids):] = torch.tensor(prompt.ids)
        mask[row, width - len(prompt.ids):] = 1
        types[row, width - len(prompt.ids):] = torch.tensor(prompt.token_types)
    with_images = [p for p in prompts if p.fields]
    pixels = {"pixel_values": torch.cat([p.fields["pixel_values"] for p in with_images]),
              "image_grid_thw": torch.cat([p.fields["image_grid_thw"] for p in with_images])}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, mm_token_type_ids=types, **pixels, do_sample=True,
                             top_k=0, top_p=1.0, max_new_tokens=NEW, min_new_tokens=NEW, num_return_sequences=G,
                             pad_token_id=0)
    return int(out.shape[0])


def vllm_rollouts(engine, requests, seed: int) -> int:
    from packfeed.client.rollouts.engine_io import Sampling

    done = engine.generate(requests, G, Sampling(max_tokens=NEW, min_tokens=NEW, temperature=1.0, seed=seed))
    assert all(len(c.token_ids) == NEW for group in done for c in group)
    return sum(len(group) for group in done)


def image_memory(image_path: Path) -> dict:
    """Bytes one prompt's image holds on the host, shared against each keeping its own (module docstring)."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    processor = Qwen2VLImageProcessor()  # Qwen2-VL's own policy
    image = Image.open(image_path).convert("RGB").resize((448, 448))
    processed = processor(images=[image], return_tensors="pt")
    pixels = processed["pixel_values"]  # what the loader server lays out, and what vLLM's processor would make
    tokens = int(processed["image_grid_thw"].prod()) // 4
    embeddings = tokens * 1536 * 2  # Qwen2-VL-2B's LLM width, bfloat16
    decoded = np.asarray(image).nbytes
    return {"pixel_bytes": pixels.numel() * pixels.element_size(), "embedding_bytes": embeddings,
            "decoded_bytes": decoded, "tokens": tokens,
            "shared": pixels.numel() * pixels.element_size() + embeddings,
            "own": 2 * pixels.numel() * pixels.element_size() + decoded}


def server_cpu_seconds(process) -> float:
    """The server's processes' CPU time (its API process and the engine core it started)."""
    import psutil

    root = psutil.Process(process.pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def main() -> None:
    from hf_models import family_dataset
    from vllm_serve import VLLMServer

    out = Path(sys.argv[1])
    data = family_dataset(out / "data", check.FAMILY, samples=PROMPTS)
    model = check.model_folder(data, out / "model")
    served = VLLMServer(out / "model", out / "vllm-serve.log")
    try:
        measure(out, data, model, served)
    finally:
        served.stop()


def measure(out: Path, data, model, served) -> None:
    from packfeed.client import LocalServer
    from packfeed.client.rollouts.engine_io import engine_request
    from packfeed.client.rollouts.prompts import prompt_job_stream, prompts_of
    from packfeed.client.rollouts.vllm_engine import VLLMEngine
    from packfeed.client.rollouts.vllm_server import VLLMServerEngine

    engine = VLLMEngine.from_pretrained(str(out / "model"), dtype="float32", max_model_len=512, enforce_eager=True,
                                        limit_mm_per_prompt={"image": 4}, seed=0)
    with LocalServer(data.index, workers=1) as server:
        stream = prompt_job_stream(server.target, "bench", consumers=1, consumer=0, per_consumer=PROMPTS)
        prompts = [p for step in stream for pack in step.packs for p in prompts_of(pack, check.FAMILY,
                                                                                    stream.conventions)]
        requests = [engine_request(p, stream.conventions) for p in prompts]
        stream.close()
    remote = VLLMServerEngine(served.wait(), tokenizer=data.tokenizer)
    vllm_rollouts(engine, requests, 99)  # warm each once
    vllm_rollouts(remote, requests, 99)
    hf_rollouts(model, prompts, 99)
    methods = (("hf_generate", lambda: hf_rollouts(model, prompts, round_), lambda: 0.0),
               ("vllm", lambda: vllm_rollouts(engine, requests, round_), lambda: 0.0),
               ("vllm_server", lambda: vllm_rollouts(remote, requests, round_),
                lambda: server_cpu_seconds(served.process)))
    for round_ in range(ROUNDS):
        for name, run, elsewhere in methods:
            wall, cpu = time.perf_counter(), cpu_seconds() + elsewhere()
            completions = run()
            print(json.dumps({"round": round_, "method": name, "seconds": time.perf_counter() - wall,
                              "cpu_seconds": cpu_seconds() + elsewhere() - cpu, "completions": completions}),
                  flush=True)
    remote.close()
    photo = next((out / "data" / "images").glob("*.jpg"))
    print(json.dumps({"memory": image_memory(photo)}), flush=True)


if __name__ == "__main__":
    main()
