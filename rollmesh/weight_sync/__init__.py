"""Weight sync: the code both ends of the trainer's weights to the engines share.

The trainer's side (rank 0 talks, every rank gathers: the synchronizer handshake, the broadcast
and its retries, overlapped syncs from a snapshot: `WeightSender`, `sync_weights`,
`finish_sync`) is `rollmesh.training.weight_sender`.

- `buckets`: the parameters cut into buckets, sent (`BucketSender`, `Snapshot`) and received by
  an engine (`receive_weights`, `receive_bucket`, `receive_bucket_into`); the HTTP body that
  announces each bucket (`update_body`).
- `group`: the weight-update process group that trainer rank 0 and the engines join.
- `tensors`: dtype names, and checking and loading received tensors into a model.
- `handles`: weights by handle on one host (`sync.transport = "handles"`): the trainer's
  shared-memory / CUDA IPC buffer, the built-in engine's msgpack table and SGLang's pickled
  `update_weights_from_tensor` payload (written, never read).

The whole sync, step by step, is in docs/architecture.md ("One weight sync, step by step"); the
synchronizer's side is `rollmesh.sync.role`; the built-in engine's is `rollmesh.engine.builtin.server`.
"""
