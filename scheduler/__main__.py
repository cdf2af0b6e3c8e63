"""`python -m scheduler`: the scheduler process that frontend/launcher.py starts (arguments: msgpack on stdin)."""

import signal
import sys

if __name__ == "__main__":
    # First, before the imports: Ctrl-C (sent to the whole group) goes to the frontend, which stops us in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from protocol.config import unpack_child_args
    from scheduler.process import run_scheduler

    run_scheduler(**unpack_child_args(sys.stdin.buffer.read()))
