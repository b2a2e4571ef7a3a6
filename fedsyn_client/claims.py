"""Who holds a reservation, and when it may be taken over (``PrivacyLedger.reserve``).

A Gaussian reservation whose process provably died before confirming is taken over by the
identical request (docs/privacy.md#crashes). "Provably" is the point: a process that may still
be computing must never be taken for dead, or one charge would buy two releases. So every test
here fails closed: another machine, another PID namespace, a PID whose liveness or start time
cannot be read (``/proc`` mounted with ``hidepid``, a process of another user) all count as alive.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def process_start(pid: int) -> str | None:
    """``pid``'s start time in clock ticks since boot: with the boot id it names one process for
    good, where a PID alone is recycled. "" when no process has that PID; None when it cannot be
    told (``/proc`` hidden or unreadable): unknown is never "gone"."""
    try:
        os.kill(pid, 0)  # works whatever /proc shows (hidepid): only "no such process" means gone
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass  # it exists, as another user
    except (OSError, OverflowError, ValueError):
        return None
    try:  # it exists (or did a moment ago): only its own start time can say it is another one
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def machine() -> str:
    """This boot of this machine, and the PID namespace whose PIDs this process sees ("" when
    unknown). Containers share the boot id but not the PIDs: a live process in another container
    is invisible here, so its claim must not look dead."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def claim(digest: str) -> dict[str, Any]:
    """Who holds a reservation: the request's digest and this process (machine, PID, start time)."""
    return {"digest": digest, "boot": machine(), "pid": os.getpid(), "start": process_start(os.getpid())}


def cut_off(entry: dict[str, Any], digest: str) -> bool:
    """True when ``entry``'s reservation was made for ``digest`` by a process that is provably
    gone: one this process can see (same boot, same PID namespace) whose PID is free or names
    another process. Anything unknown counts as alive."""
    held = entry.get("claim") or {}
    if held.get("digest") != digest or not held.get("boot") or held["boot"] != machine() or not held.get("start"):
        return False
    now = process_start(int(held["pid"]))
    return now is not None and now != held["start"]
