"""A vLLM server as the rollout worker's engine, over HTTP: for rollout processes that hold no model (the engine on
its own GPUs, scaled and restarted on its own). Start the server as vLLM's docs say, with these settings:

    VLLM_SERVER_DEV_MODE=1 vllm serve /models/qwen2-vl --enable-scale-out --no-mm-device-do-normalize \\
        --logprobs-mode processed_logprobs
    engine = VLLMServerEngine("http://gpu-7:8000", tokenizer="qwen2_vl/tokenizer.json",
                              staging="/shared/run-7/engine-weights")

**Prompts and images.** The server's tokens-in endpoint (`POST /inference/v1/generate`, which `--enable-scale-out`
opens) takes a prompt's tokens already expanded, each image's placeholder positions, and each image's processed
inputs (vLLM's `MultiModalKwargsItem`, msgpack in base64: `pixel_values` and `image_grid_thw`). So the trainer's
tokens and the loader server's pixel values go as they are, the server's own vision tower embeds those pixels, and
the engine and the trainer read one preprocessing. `--no-mm-device-do-normalize` is needed because those pixels are
normalised already. The OpenAI endpoints cannot carry that: `/v1/completions` takes no images beside token ids, and
`/v1/chat/completions` takes either raw images, which the server would decode, resize and normalise a second time,
or embeddings, which would need a vision tower in the rollout process. An image's hash, the server's cache key, is
a digest of its pixel values and grid.

**Log-probabilities.** The sampled token's log-probability after temperature (`--logprobs-mode processed_logprobs`),
as `VLLMEngine`'s.

**Weights.** `load_version` places the version's file at `staging/v<version>/model.safetensors` (linked from a
local `WeightVersions` folder, downloaded from an object store). It then has the server reload its weights in place
from that folder (`POST /collective_rpc` reload_weights) and empties what the old weights computed: its
encoder, multimodal and prefix caches (`/reset_encoder_cache`, `/reset_mm_cache`, `/reset_prefix_cache`). These
endpoints need VLLM_SERVER_DEV_MODE=1 on the server.
`staging` must be a folder the server reads at the same path. By default it is `.engine` inside a local
WeightVersions folder; with weights in an object store, give one. Older staged versions are removed.

**Checks.** On connecting, the engine reads the server's configuration (`GET /server_info`) and refuses a server
whose settings would give wrong rollouts without an error: pixel values normalised again, or log-probabilities
before temperature. A failed request raises, naming the server's answer. On a CPU server, give it
`--max-num-batched-tokens` at least a batch's prompt tokens: vLLM's CPU random generators cannot rewind, so seeded
sampling fails once it splits a prefill (docs/live.md).
"""

from __future__ import annotations

import base64
import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from packfeed.client.rollouts.engine_io import Completion, EngineRequest, Sampling
from packfeed.client.rollouts.weights import WeightVersions
from packfeed.client.stream.channel import PackfeedError
from packfeed.media.storage import is_object_url

GENERATE = "/inference/v1/generate"
REQUIRED = {"mm_device_do_normalize": (False, "--no-mm-device-do-normalize"),
            "logprobs_mode": ("processed_logprobs", "--logprobs-mode processed_logprobs")}
RAW_VIEW = 3  # vLLM's msgpack extension type for a tensor's bytes


class VLLMServerEngine:
    """A vLLM server behind the rollout worker's `Engine` face (see the module's docstring). `tokenizer`: the
    dataset's tokenizer.json (completions are decoded here, for reward functions); `concurrency`: requests in
    flight at once (the server batches them); `timeout_s`: one request's limit."""

    def __init__(self, url: str, *, tokenizer: str | Path, staging: str | Path | None = None,
                 concurrency: int = 64, timeout_s: float = 600.0):
        import requests
        from tokenizers import Tokenizer

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.staging = None if staging is None else Path(staging)
        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="vllm-server")
        self._check_settings()

    def _check_settings(self) -> None:
        info = self._call("GET", "/server_info", params={"config_format": "json"})
        model = info["vllm_config"]["model_config"]
        settings = {"logprobs_mode": model.get("logprobs_mode"),
                    "mm_device_do_normalize": (model.get("multimodal_config") or {}).get("mm_device_do_normalize",
                                                                                          False)}
        wrong = [flag for name, (want, flag) in REQUIRED.items() if settings[name] != want]
        if wrong:
            raise PackfeedError(f"the vLLM server at {self.url} runs with {settings}: start it with "
                                f"{' and '.join(wrong)} (the module's docstring says why)")

    def generate(self, requests: list[EngineRequest], n: int, sampling: Sampling) -> list[list[Completion]]:
        bodies = [self._body(request, n, sampling) for request in requests]
        answers = self.pool.map(lambda body: self._call("POST", GENERATE, json=body), bodies)
        return [[_completion(choice) for choice in sorted(answer["choices"], key=lambda c: c["index"])]
                for answer in answers]

    def _body(self, request: EngineRequest, n: int, sampling: Sampling) -> dict[str, Any]:
        ids, spans = request.expanded()
        body: dict[str, Any] = {
            "token_ids": ids,
            "sampling_params": {"n": n, "max_tokens": sampling.max_tokens, "min_tokens": sampling.min_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "top_k": sampling.top_k or -1, "min_p": sampling.min_p,
                                "repetition_penalty": sampling.repetition_penalty, "logprobs": 0,
                                "seed": sampling.seed_of(request.key),
                                "stop_token_ids": list(sampling.stop_token_ids), "detokenize": False}}
        if request.images:
            items = _image_items(request.pixel_values, request.image_grid_thw)
            body["features"] = {"mm_hashes": {"image": [hash_of for hash_of, _ in items]},
                                "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in spans]},
                                "kwargs_data": {"image": [item for _, item in items]}}
        return body

    def load_version(self, weights: WeightVersions, version: int, timeout_s: float) -> None:
        weights.wait_published(version, timeout_s)
        staging = self._staging(weights)
        folder = staging / f"v{version:010d}"
        weights.place(version, folder / "model.safetensors")
        self._call("POST", "/collective_rpc", json={"method": "reload_weights",
                                                    "kwargs": {"weights_path": str(folder.resolve())}})
        # what the old weights computed, everywhere the server keeps it: the worker's caches, which reloading
        # empties, and the scheduler's record of them, which it does not (the next image would miss its cache)
        for cache in ("/reset_encoder_cache", "/reset_mm_cache"):
            self._call("POST", cache)
        if not (self._call("POST", "/reset_prefix_cache") or {}).get("success", True):
            raise PackfeedError(f"the vLLM server at {self.url} could not empty its prefix cache after loading "
                                f"version {version}: requests still running hold it")
        for older in staging.glob("v*"):
            if older.name < folder.name:
                shutil.rmtree(older, ignore_errors=True)

    def _staging(self, weights: WeightVersions) -> Path:
        if self.staging is not None:
            return self.staging
        if is_object_url(weights.root):
            raise PackfeedError(f"the weights are in an object store ({weights.root}): give VLLMServerEngine "
                                "staging=, a folder the vLLM server reads at the same path")
        return Path(weights.root) / ".engine"

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def close(self) -> None:
        self.pool.shutdown()
        self.session.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        import requests

        try:
            answer = self.session.request(method, self.url + path, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as error:
            raise PackfeedError(f"the vLLM server at {self.url} did not answer {method} {path}: {error}") from None
        if answer.status_code == 404 and path == GENERATE:
            raise PackfeedError(f"the vLLM server at {self.url} has no {GENERATE}: start it with --enable-scale-out")
        if answer.status_code == 404 and path != GENERATE:
            raise PackfeedError(f"the vLLM server at {self.url} has no {path}: start it with "
                                "VLLM_SERVER_DEV_MODE=1 in its environment")
        if answer.status_code != 200:
            raise PackfeedError(f"the vLLM server at {self.url} answered {method} {path} with "
                                f"{answer.status_code}: {answer.text[:2000]}")
        return answer.json() if answer.content else None


def _image_items(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[tuple[str, str]]:
    """Each image's (hash, processed inputs as vLLM's msgpack `MultiModalKwargsItem` in base64): its rows of the
    pixel values (a flat field over its patches) and its grid (a batched field, kept on the CPU)."""
    import msgpack

    sizes = image_grid_thw.prod(dim=1).tolist()
    items = []
    for pixels, grid in zip(pixel_values.split(sizes), image_grid_thw):
        pixels, grid = pixels.contiguous(), grid.contiguous()
        item = {"pixel_values": {"data": _tensor(pixels),
                                 "field": ["flat", {"keep_on_cpu": False, "slices": [[[0, len(pixels), None]]],
                                                    "dim": 0}]},
                "image_grid_thw": {"data": _tensor(grid), "field": ["batched", {"keep_on_cpu": True}]}}
        digest = hashlib.blake2b(_bytes(grid) + _bytes(pixels), digest_size=16).hexdigest()
        items.append((digest, base64.b64encode(msgpack.packb(item, use_bin_type=True)).decode("ascii")))
    return items


def _tensor(tensor: torch.Tensor) -> list[Any]:
    import msgpack

    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), msgpack.ExtType(RAW_VIEW, _bytes(tensor))]


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()  # any dtype, numpy's or not (bfloat16)


def _completion(choice: dict[str, Any]) -> Completion:
    """A tokens-in choice as a Completion: the sampled token's log-probability at each position."""
    ids = choice.get("token_ids") or []
    positions = (choice.get("logprobs") or {}).get("content") or []
    return Completion(np.asarray(ids, np.int64), np.asarray([p["logprob"] for p in positions], np.float32),
                      choice.get("finish_reason") == "stop")
