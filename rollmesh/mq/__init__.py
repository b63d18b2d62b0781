"""The MessageQueue: its role process (`role`), its state and durable log without sockets
(`store`: the queued groups, the staleness bound at hand-out, back-pressure), and what its
clients run (`client`: the rollouter's puts, the trainer's stream of batches)."""
