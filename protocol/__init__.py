"""What crosses a process boundary: messages, the msgpack codec, configs, socket addresses."""
