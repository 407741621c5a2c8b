"""A step's rollouts as verl's trainers hold them on the driver, built from arrays (for the scripts that run in
verl's environment, tests/verl_env.py): a `DataProto` for verl's legacy trainer, a TransferQueue `KVBatchMeta`
for its v1 trainers."""

from __future__ import annotations

import numpy as np
import torch
from transfer_queue import KVBatchMeta
from verl import DataProto


def data_proto(tokens: np.ndarray, prompt: np.ndarray, uid: np.ndarray, grids: list) -> DataProto:
    """As verl's rollout workers leave a step: prompts left-padded, responses right-padded, rows in `index`."""
    width_p, width_r = int(prompt.max()), int((tokens - prompt).max())
    mask = torch.zeros(len(tokens), width_p + width_r, dtype=torch.long)
    for i, (t, p) in enumerate(zip(tokens.tolist(), prompt.tolist())):
        mask[i, width_p - p:width_p + (t - p)] = 1
    tensors = {"attention_mask": mask, "prompts": torch.zeros(len(tokens), width_p, dtype=torch.long),
               "responses": torch.zeros(len(tokens), width_r, dtype=torch.long), "index": torch.arange(len(tokens))}
    inputs = np.array([{"image_grid_thw": torch.tensor(g, dtype=torch.long).reshape(-1, 3)} for g in grids],
                      dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid.astype(object), "multi_modal_inputs": inputs})


def kv_batch(tokens: np.ndarray, prompt: np.ndarray, uid: np.ndarray) -> KVBatchMeta:
    """As verl's v1 agent loop tags a step in TransferQueue: keys `{uid}_{session}_{index}`, token counts."""
    keys = [f"{u}_{i}_0" for i, u in enumerate(uid.tolist())]
    tags = [{"status": "success", "prompt_len": int(p), "response_len": int(t - p), "seq_len": int(t), "row": i}
            for i, (t, p) in enumerate(zip(tokens.tolist(), prompt.tolist()))]
    return KVBatchMeta(keys=keys, tags=tags, partition_id="train")
