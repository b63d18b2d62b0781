"""The MessageQueue role (`role`): the queued groups, the staleness bound at hand-out, back-pressure, its durable log."""
