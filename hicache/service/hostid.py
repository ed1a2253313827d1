"""Which machine this is, as seen from inside any container on it.

Containers and pods of one machine usually have hostnames of their own, so a hostname cannot tell an
engine whether a node's shared pool (POSIX shared memory, CUDA IPC) is on its machine. The kernel's boot
id can: it is one random id per boot of the kernel, the same in every container that kernel runs.
"""

from __future__ import annotations

from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """The kernel's boot id, or ``""`` where the system does not expose one (not Linux)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""
