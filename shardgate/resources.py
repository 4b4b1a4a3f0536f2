"""Resource alarms, as RabbitMQ's: above a memory high watermark publishers are blocked, and
below a free-disk limit reliable publishes are refused, until the node has room again.

Checked on a timer (`CHECK_S`), never per message: one read of `/proc/self/statm` and one
`statvfs` of the data directory a second.

- **Memory** (`memory_high_watermark`: a fraction of the machine's memory, or of the cgroup
  limit when lower, as RabbitMQ's `vm_memory_high_watermark`; above 1 a number of bytes; 0
  off): while the process's resident memory is above it, publishers are held: AMQP
  connections that publish get connection.blocked and are not read until connection.unblocked,
  MQTT connections that publish are not read, gRPC producers wait before their next batch
  (the call's deadline bounds a unary Publish). It clears below 90 % of the watermark.
- **Disk** (`disk_free_limit` bytes, as RabbitMQ's `disk_free_limit`): while the file system
  of the data directory has less free space, the journal refuses appends (`JournalStorage.
  refuse_appends`): a reliable publish gets the protocol's quota error (MQTT 5 PUBACK 0x97,
  AMQP basic.nack, gRPC RESOURCE_EXHAUSTED), a QoS 0 one is dropped and counted. Non-reliable
  streams are not stored and go on. It clears above the limit plus 10 %.

Each change is logged once (a warning when set, info when cleared).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CHECK_S = 1.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def physical_memory() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit when lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * _PAGE
    except (ValueError, OSError, AttributeError):
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < (total or 1 << 62):
            total = int(text)
    return total


def watermark_bytes(setting: float) -> int:
    """The watermark in bytes: a fraction of `physical_memory()` up to 1, else bytes; 0 off."""
    if setting <= 0:
        return 0
    if setting <= 1:
        return int(physical_memory() * setting)
    return int(setting)


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class ResourceAlarms:
    """The two alarms of one node; `on_memory(blocked)` and `on_disk(reason | None)` are told
    each change (the composition root wires them to the protocols and the journal)."""

    def __init__(self, data_dir: Path, memory_high_watermark: float, disk_free_limit: int,
                 on_memory: Callable[[bool], None], on_disk: Callable[[str | None], None],
                 resident: Callable[[], int] = resident_bytes,
                 free_disk: Callable[[], int] | None = None) -> None:
        self.data_dir = data_dir
        self.memory_limit = watermark_bytes(memory_high_watermark)
        self.disk_free_limit = disk_free_limit
        self._on_memory = on_memory
        self._on_disk = on_disk
        self._resident = resident
        self._free_disk = free_disk or (lambda: shutil.disk_usage(self.data_dir).free)
        self.memory_alarm = False
        self.disk_alarm = False
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.check()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def check(self) -> None:
        """Look at memory and disk once, raise or clear each alarm, and check again later."""
        try:
            self._check_memory()
            self._check_disk()
        except Exception:  # noqa: BLE001 - a failed look is tried again at the next tick
            log.exception("checking memory and disk failed")
        self._timer = asyncio.get_running_loop().call_later(CHECK_S, self.check)

    def _check_memory(self) -> None:
        limit = self.memory_limit
        if not limit:
            return
        used = self._resident()
        if not self.memory_alarm and used > limit:
            self.memory_alarm = True
            log.warning("memory alarm: the broker uses %d MiB, above memory_high_watermark "
                        "(%d MiB): publishers are blocked until it falls below %d MiB",
                        used >> 20, limit >> 20, (limit * 9 // 10) >> 20,
                        extra={"event": "memory_alarm", "alarm": True})
            self._on_memory(True)
        elif self.memory_alarm and used < limit * 9 // 10:
            self.memory_alarm = False
            log.info("memory alarm cleared: the broker uses %d MiB; publishers resume",
                     used >> 20, extra={"event": "memory_alarm", "alarm": False})
            self._on_memory(False)

    def _check_disk(self) -> None:
        limit = self.disk_free_limit
        if limit <= 0:
            return
        free = self._free_disk()
        if not self.disk_alarm and free < limit:
            self.disk_alarm = True
            reason = (f"the broker's disk has {free >> 20} MiB free, below disk_free_limit "
                      f"({limit >> 20} MiB)")
            log.warning("disk alarm: %s: reliable publishes are refused until it has more room",
                        reason, extra={"event": "disk_alarm", "alarm": True})
            self._on_disk(reason)
        elif self.disk_alarm and free > limit + limit // 10:
            self.disk_alarm = False
            log.info("disk alarm cleared: %d MiB free; reliable publishes are accepted again",
                     free >> 20, extra={"event": "disk_alarm", "alarm": False})
            self._on_disk(None)
