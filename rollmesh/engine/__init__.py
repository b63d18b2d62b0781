"""Inference engines: the client every role uses, what the built-in engine's OpenAI routes and
the agents' OpenAI endpoint share (`openai_common`), and rollmesh's built-in engine server.

Nothing here imports torch at package import time: a role that only needs the HTTP client must
not pay for (or require) the model stack.
"""
