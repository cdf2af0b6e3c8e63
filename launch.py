"""Pico-vLLM's entry point: `python launch.py --model qwen2.5-1.5b` serves the OpenAI API.

`--prompt TEXT` runs one prompt offline; `--headless --engine-address ADDR` serves the engine to other
frontends over ZeroMQ (protocol/PROTOCOL.md). `--help` lists every flag."""

import sys

from frontend.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
