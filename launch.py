"""Pico-vLLM's entry point: `python launch.py --model qwen2.5-1.5b` serves the OpenAI API.

`--prompt TEXT` runs one prompt offline; `--headless --engine-address ADDR` serves the engine to other
frontends over ZeroMQ (protocol/PROTOCOL.md). `--help` lists every flag.
"""
import sys

if __name__ == "__main__":
    # Imported here, not at the top: the engine's processes start by spawn, which runs this file's top level
    # again in each child, and the server's imports (FastAPI, transformers) would delay every child by ~1 s.
    from frontend.cli import main

    sys.exit(main(sys.argv[1:]))
