"""The wire: the msgpack records every role exchanges (`messages`) and their strict codec
(`protocol`), and the ZeroMQ sockets that carry them: request-reply and CURVE (`transport`),
the rollouter's channels, the status hub and heartbeats (`channels`)."""
