"""`python -m service.lifeline PARENT_PID -- CMD ...`: exec CMD so that the kernel sends it
SIGTERM when PARENT_PID dies.

`tail-ray up` stops what it started on SIGTERM, SIGHUP and Ctrl-C; this covers the one signal it
cannot catch (SIGKILL, or an OOM kill): its Ray head and service then stop too instead of
living on as orphans that hold the ports and the database. Linux only (``PR_SET_PDEATHSIG``,
kept across ``execve``); elsewhere CMD simply runs. A wrapper that execs, rather than a
``preexec_fn``, because ``preexec_fn`` is unsafe in a process with threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m service.lifeline PARENT_PID -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent, cmd = int(argv[0]), argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            print(f"lifeline: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
        elif os.getppid() != parent:  # the parent died before prctl took effect
            return 1
    os.execvp(cmd[0], cmd)
    return 127  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
