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


def gpu_kv_budget(
    total: int,
    free: int,
    utilization: float,
    layers: int,
    activation_bytes: int,
) -> int:
    """KV pool bytes on a GPU (vLLM's ``gpu_memory_utilization`` rule): the engine may
    fill ``utilization`` of the card, counting what is already in use (the loaded
    weights, other processes), less room for activations: ``activation_bytes`` (logits
    and the like) plus one layer's gathered K/V, which attention copies out of the pool
    and which can be as large as the pool's share of one layer (1/layers of it).

    total, free: the card's memory and what is free now, in bytes."""
    if not 0 < utilization <= 1:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")
    room = int(utilization * total) - (total - free) - activation_bytes
    budget = room * layers // (layers + 1)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB free, {utilization:.2f} of the card allowed, "
            f"{activation_bytes / 2**30:.1f} GiB kept for activations"
        )
    return budget
