"""Child processes of launchers (``kvtier pool mooncake``, ``kvtier bench pd``, the tests' Valkey
and engine servers): each is killed when its launcher exits — by the kernel if the launcher dies (PR_SET_PDEATHSIG, Linux, set
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
        _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def spawn(cmd: list[str], **popen_kw) -> subprocess.Popen:
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


def signal_and_wait(p: subprocess.Popen | None, sig: int, timeout: float, group: bool = False) -> bool:
    """Send ``sig`` to ``p`` (to its process group: ``group``; resumed first, a stopped process
    cannot handle SIGTERM) and wait up to ``timeout`` s; True once it exited (then forgotten)."""
    if p is None:
        return True
    if p.poll() is None:
        send = (lambda s: os.killpg(p.pid, s)) if group else (lambda s: os.kill(p.pid, s))
        try:
            send(signal.SIGCONT)
            send(sig)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    forget(p)
    return True


def stop(p: subprocess.Popen | None, grace: float = 5.0, group: bool = False) -> None:
    """SIGTERM, then SIGKILL if ``p`` is still running after ``grace`` seconds."""
    if not signal_and_wait(p, signal.SIGTERM, grace, group):
        signal_and_wait(p, signal.SIGKILL, 10, group)


@atexit.register
def _kill_leftovers() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
        _LIVE.clear()
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            p.kill()
            p.wait(timeout=5)
        except Exception:
            pass
