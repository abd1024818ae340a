"""Child processes of pool launchers (``kvtier pool mooncake``, the tests' Valkey servers): each is
killed when its launcher exits — by the kernel if the launcher dies (PR_SET_PDEATHSIG, Linux, set
only from the main thread: the signal fires when the *thread* that forked exits), else at exit.
Written by hand: subprocess has no "die with the parent" option."""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading

_LIBC = None
_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    global _LIBC
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except Exception:
        pass


def spawn(cmd: list[str], **popen_kw) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """Popen(cmd, **popen_kw), tracked until :func:`forget`; dies with its launcher."""
    pdeath = sys.platform == "linux" and threading.current_thread() is threading.main_thread()
    p = subprocess.Popen(cmd, preexec_fn=_die_with_parent if pdeath else None, **popen_kw)
    with _LIVE_LOCK:
        _LIVE[p.pid] = p
    return p


def forget(p: subprocess.Popen) -> None:
    """``p`` has exited (or was stopped on purpose): stop tracking it."""
    with _LIVE_LOCK:
        _LIVE.pop(p.pid, None)


@atexit.register
def _kill_leftovers() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
        _LIVE.clear()
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)   # a stopped process must run to die cleanly
            p.kill()
            p.wait(timeout=5)
        except Exception:
            pass
