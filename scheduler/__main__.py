"""`python -m scheduler`: the scheduler process that frontend/launcher.py starts (arguments: msgpack on stdin)."""

import signal
import sys

from protocol.config import unpack_child_args
from scheduler.process import run_scheduler

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the frontend, which stops us in order
    run_scheduler(**unpack_child_args(sys.stdin.buffer.read()))
