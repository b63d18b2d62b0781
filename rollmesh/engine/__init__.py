"""Inference engines: the client every role uses, and rollmesh's built-in engine server.

Nothing here imports torch at package import time: a role that only needs the HTTP client must
not pay for (or require) the model stack.
"""
