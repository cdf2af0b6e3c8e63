"""`python -m worker`: one worker rank that frontend/launcher.py starts (arguments: msgpack on stdin)."""

import logging
import os
import signal
import sys
import traceback

if __name__ == "__main__":
    # First, before torch's imports: Ctrl-C (sent to the whole group) goes to the frontend, which stops us in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from protocol.config import unpack_child_args
    from worker.process import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_worker(**unpack_child_args(sys.stdin.buffer.read()))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # run_worker has flushed its trace and closed its sockets. Skipping the interpreter's teardown is what keeps
    # Triton's nanobind from printing ~30 lines of "leaked instances" warnings at every exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
