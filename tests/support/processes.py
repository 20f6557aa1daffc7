"""Waiting on processes and conditions with a deadline, instead of fixed sleeps."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "the condition") -> T:
    """Poll ``condition()`` every ``interval`` seconds until it returns something truthy, and return
    that; raise ``TimeoutError`` naming ``what`` if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(interval)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a reaped-later corpse holds no resources)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (arguments separated by NUL), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` in the process tree (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def wait_gone(pids: Iterable[int], seconds: float = 10.0) -> list[int]:
    """Wait up to ``seconds`` for every process of ``pids`` to end; return those still alive."""
    pids = list(pids)
    try:
        wait_until(lambda: not any(alive(p) for p in pids), seconds, interval=0.1, what="the processes' end")
    except TimeoutError:
        pass
    return [p for p in pids if alive(p)]


def shm_mapped() -> set[str]:
    """The /dev/shm entries some live process maps (from every readable ``/proc/<pid>/maps``)."""
    mapped = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as f:
                    mapped.update(line.rsplit("/dev/shm/", 1)[1].strip() for line in f if "/dev/shm/" in line)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
    return {name.removesuffix(" (deleted)") for name in mapped}


def shm_left_behind(before: set[str]) -> set[str]:
    """The /dev/shm entries created since ``before`` that no live process maps: what the processes
    that ended left behind. Entries that other running work (a parallel test) holds are not counted;
    one that was just unmapped and is about to be unlinked is, so wait on this coming back empty."""
    try:
        new = set(os.listdir("/dev/shm")) - before
    except FileNotFoundError:
        return set()
    return new - shm_mapped() if new else set()
