"""rollmesh: fully-asynchronous RL post-training for LLMs, as independent processes over ZeroMQ."""

__version__ = "0.1.0"
