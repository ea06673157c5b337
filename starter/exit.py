"""Ending a process that used the Temporal client without crashing on the way out.

temporalio's Rust runtime keeps threads that can call into Python while the interpreter is
finalizing, which aborts the process ("PyGILState_Release: thread state ... must be current",
temporalio/sdk-python#300) and turns a clean exit into SIGABRT. Once a command's work is done
and its output flushed, skip interpreter finalization.
"""

from __future__ import annotations

import os
import sys


def exit_without_finalizing(code: object) -> None:
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
