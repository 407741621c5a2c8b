"""Simulators of training steps.

- The cluster simulator (`packfeed simulate`; library: `predict.simulate_plan`) predicts a plan's step and epoch
  time, bubbles and MFU on a cluster for each data strategy and encoder placement: `model_shape` (what each
  layer costs), `cluster` (GPUs and links), `workload` (what each microbatch carries), `partition` (layers into
  stages), `schedule` (pipeline orders and the event-driven engine), `placement` (one step for each encoder
  placement), `predict` (epochs, the disaggregated split search), `report` and `command`.
- `calibrated`: the trainer's own pipeline simulator, fitted to measured layer costs (needs torch).

Importing this package imports nothing: the cluster simulator runs where torch is not installed.
"""
