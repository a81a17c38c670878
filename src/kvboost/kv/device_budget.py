"""How many bytes of stored chunks the model's device keeps before the coldest move to host memory."""
from __future__ import annotations

import torch

DEFAULT_DEVICE_KV_FRACTION = 0.3  # of the device memory free when the engine is built (device_kv_budget_bytes)


def device_kv_budget(configured: int | None, device: torch.device) -> int | None:
    """The device's budget for stored chunks (None: no host tier): as configured, else on CUDA a share of free memory"""
    if configured is not None or device.type != "cuda":
        return configured
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * DEFAULT_DEVICE_KV_FRACTION)
