"""User and system CPU seconds, and peak resident memory, of a process and all its
descendants, from /proc (no psutil, no vlmserve: every worker imports it, whatever its venv)."""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, user, sys) of a live process in clock ticks, its reaped children's included
    (utime + cutime, stime + cstime); None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    # after the name: state(3) ppid(4) ... utime(14) stime(15) cutime(16) cstime(17), numbered as in proc(5)
    return int(fields[1]), int(fields[11]) + int(fields[13]), int(fields[12]) + int(fields[14])


def _all_stats() -> dict[int, tuple[int, int, int]]:
    stats = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    return stats


def descendants(pid: int, stats: dict[int, tuple[int, int, int]] | None = None) -> set[int]:
    """pid and every process whose chain of parents reaches it."""
    stats = _all_stats() if stats is None else stats
    children: dict[int, list[int]] = {}
    for child, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(child)
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(children.get(p, ()))
    return found


def cpu_times(pid: int | None = None) -> tuple[float, float]:
    """(user, sys) CPU seconds used so far by pid (default: this process) and its descendants.
    Take one snapshot before and one after a run: the difference is what the run used
    (a descendant that exits in between counts once its parent in the tree has reaped it)."""
    pid = os.getpid() if pid is None else pid
    stats = _all_stats()
    user = system = 0
    for p in descendants(pid, stats):
        if p in stats:
            user += stats[p][1]
            system += stats[p][2]
    return user / TICK, system / TICK


def peak_rss_bytes(pid: int | None = None) -> int:
    """The peak resident memory (VmHWM) of pid (default: this process) and its live
    descendants, added up (an engine's server process counts with its worker)."""
    pid = os.getpid() if pid is None else pid
    total = 0
    for p in descendants(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total
