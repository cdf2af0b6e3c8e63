"""`python -m worker`: one worker rank that frontend/launcher.py starts (arguments: msgpack on stdin)."""
import signal
import sys

from protocol.config import unpack_child_args
from worker.process import run_worker

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the frontend, which stops us in order
    run_worker(**unpack_child_args(sys.stdin.buffer.read()))
