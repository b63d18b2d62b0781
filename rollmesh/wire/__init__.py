"""The wire: the msgpack records every role exchanges (`protocol`) and the ZeroMQ sockets that carry them (`transport`)."""
