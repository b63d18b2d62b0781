"""Training: the trainer role (`role`) and what it and `rollmesh sft` (`sft`) compute with.

- `state`: the trainer's state (`TrainState`) and how it is built: the policy, the reference,
  the critic (`Critic`), their FSDP2 sharding, optimizers and schedules (`build_state`).
- `step`: one step's math: this rank's micro-batches (`micro_batches`, the one loop of every
  pass over a batch), old and reference log-probs, advantages (`prepare`), the loss and the
  optimizer updates (`update_policy`), the step's metrics.
- `batching`: a batch of groups as right-padded tensors (`BatchData`, `from_groups`), how its
  sequences are dealt to ranks and cut into micro-batches (`plan`), and per-sample staleness.
- `weight_sender`: the trainer's side of a weight sync (`WeightSender`, `sync_weights`,
  `finish_sync`; what both ends share is `rollmesh.weight_sync`).
- `ranks`: the ranks among themselves (`Ranks`: rank 0's orders, sums, gathers); `checkpoint`:
  checkpoints and policy exports; `metrics_sink`: metrics rows to TensorBoard and W&B.
"""
