"""How many bytes of stored chunks the model's device keeps before the coldest move to host memory.

The store's device tier (TieredStore's memory tier, store/host.py behind it) has this budget; the default for
device_kv_max_tokens (kv/long_context.py) counts it as taken.
"""
from __future__ import annotations

import torch

DEFAULT_DEVICE_KV_FRACTION = 0.3  # of the device memory free when the engine is built (device_kv_budget_bytes)


def device_kv_budget(configured: int | None, device: torch.device) -> int | None:
    """The device's budget for stored chunks (None: no host tier): as configured, else on CUDA
    DEFAULT_DEVICE_KV_FRACTION of the device memory free now; elsewhere None (the device is host memory)."""
    if configured is not None or device.type != "cuda":
        return configured
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * DEFAULT_DEVICE_KV_FRACTION)
