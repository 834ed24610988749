"""Host resources (torch-free: the engine and the simulator both size KV pools with it)."""

from __future__ import annotations


def available_ram() -> int:
    """Bytes of available memory (``MemAvailable``), 8 GiB when it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_kv_budget() -> int:
    """The default KV pool size: a quarter of available RAM, at most 4 GiB."""
    return min(available_ram() // 4, 4 << 30)
