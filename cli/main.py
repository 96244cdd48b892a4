"""Command line: ``python -m pixart_lowvram demo``, ``generate``, ``cache``, and ``queue`` (a workflow on a
ComfyUI server); the commands are in :mod:`.commands`.

This module imports nothing heavy, so that what it says on a mistake, a failure or Ctrl-C holds from the
first moment, through the seconds torch and diffusers take to import: one line, never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

# What a mistake or a failure raises; said in one line, exit status 2.
ERRORS = (ValueError, TypeError, OSError, ImportError, RuntimeError)


def main(argv: list[str] | None = None) -> int:
    interrupts: list[int] = []

    def on_interrupt(signum, _frame):
        interrupts.append(signum)
        raise KeyboardInterrupt

    # Python's own handler, which also notes the Ctrl-C: transformers' lazy imports turn the
    # KeyboardInterrupt into a RuntimeError ("Failed to import …"), which is an interrupt all the same.
    # Where SIGINT is ignored (nohup, a background job) it stays ignored.
    ours = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if ours:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        from . import commands

        commands.main(argv)
        sys.stdout.flush()  # a closed stdout shows here, inside the handler below, not at exit
        return 0
    except BrokenPipeError:
        # As Python's documentation advises (signal module, "Note on SIGPIPE"): stdout's reader is gone,
        # so point stdout at devnull for the flush at exit, and end quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (KeyboardInterrupt, *ERRORS) as exc:
        if not interrupts and not isinstance(exc, KeyboardInterrupt):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # The random model and the cache entries are staged and renamed into place, their staging
        # removed when interrupted: nothing partial is left.
        print("interrupted", file=sys.stderr)
        # The interrupt goes on up with no traceback, so that Python ends the process as on any Ctrl-C:
        # after its usual cleanup, killed by SIGINT (status 130 in a shell), which also stops a shell
        # script's loop (a plain exit status would let the loop run on).
        sys.excepthook = lambda *_: None
        raise KeyboardInterrupt from None
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
