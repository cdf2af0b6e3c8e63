"""Pico-vLLM's entry point: `python launch.py --model qwen2.5-1.5b` serves the OpenAI API.

`--prompt TEXT` runs one prompt offline; `--headless --engine-address ADDR` serves the engine to other
frontends over ZeroMQ (protocol/PROTOCOL.md). `--help` lists every flag."""

import signal
import sys


class _Terminated(BaseException):
    """SIGTERM when uvicorn does not hold it (start-up, --prompt): unwinds as Ctrl-C does, stopping the children."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)  # before the imports: a signal during them ends quietly too
    try:
        from frontend.cli import main

        code = main(sys.argv[1:])
    except KeyboardInterrupt:
        code = 130
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # end by the signal, as supervisors expect (status 143)
    sys.exit(code)
