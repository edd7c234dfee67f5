"""How much memory this machine has free for a new allocation, from the OS (no extra package)."""

from __future__ import annotations

import os
from pathlib import Path

try:
    import resource  # POSIX only
except ImportError:  # pragma: no cover (Windows)
    resource = None  # type: ignore[assignment]

_CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    """Linux's ``MemAvailable`` (what can be allocated without swapping), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> int | None:
    """Free physical pages times the page size, where the OS names them (not macOS)."""
    try:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _cgroup_room() -> int | None:
    """A container's limit less what it already uses (cgroup v2), where one is set."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((_CGROUP / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def _address_space_room() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) leaves this process: its limit less the address space it maps now."""
    if resource is None:
        return None
    try:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, limit - int(line.split()[1]) * 1024)
        return limit
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """Bytes this process can still allocate in RAM (the least of the machine's available memory,
    its container's room and its address-space limit); None where the OS does not say."""
    rooms = (_meminfo_available() or _sysconf_available(), _cgroup_room(), _address_space_room())
    known = [n for n in rooms if n is not None]
    return min(known) if known else None


def gigabytes(n: float) -> str:
    """``n`` bytes for people: ``1.5 GB``, ``4,096.0 GB``."""
    return f"{n / 1e9:,.1f} GB"
