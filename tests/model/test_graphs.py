"""model/graphs.py: a capture is refused (before anything is captured) when the device is nearly full, and a failed
capture leaves the thread's stream and torch's allocator as they were."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvboost.model.graphs import (
    CaptureFailed,
    CaptureRefused,
    GraphSteps,
    capture_refusal,
    capture_step,
)


def _device_memory(monkeypatch, free: int, reserved: int = 0, allocated: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def test_a_capture_is_refused_when_the_device_is_nearly_full(monkeypatch):
    """On an H100 filled by other processes a capture that ran out of memory aborted the process; the runners now
    check first, and auto mode then runs the step eagerly (an eager forward that runs out of memory raises)."""
    _device_memory(monkeypatch, free=100 << 20)
    reason = capture_refusal(torch.device("cuda"))
    assert reason is not None and "100 MiB" in reason
    ran = []
    with pytest.raises(CaptureRefused, match="100 MiB") as failed:
        capture_step(lambda: ran.append(1), torch.device("cuda"))
    assert not ran and isinstance(failed.value.cause, RuntimeError)  # refused before the step ran at all
    _device_memory(monkeypatch, free=2 << 30)
    assert capture_refusal(torch.device("cuda")) is None


def test_memory_torch_caches_unused_counts_as_room_for_a_capture(monkeypatch):
    """The driver's free memory leaves out what torch's allocator holds cached (after a long eager prefill, GBs),
    which the capture empties first: that is room, not a reason to refuse."""
    _device_memory(monkeypatch, free=100 << 20, reserved=6 << 30, allocated=5 << 30)
    assert capture_refusal(torch.device("cuda")) is None
    _device_memory(monkeypatch, free=100 << 20, reserved=6 << 30, allocated=6 << 30)
    assert "100 MiB" in capture_refusal(torch.device("cuda"))


class _Step:
    graph = None
    logits = None


class _Runner(GraphSteps):
    """GraphSteps with a step that returns a constant, on a "CUDA" device whose memory reads as full."""

    def __init__(self, fallback: bool):
        self.mode, self.fallback_on_failure, self.stats, self.failure = "graphs", fallback, Counter(), None
        self.forgotten = 0

    def _run(self, step):
        return torch.ones(3)

    def _device(self):
        return torch.device("cuda")

    def _forget_graphs(self):
        self.forgotten += 1


def test_a_refused_capture_runs_that_step_eagerly_in_auto_mode_and_raises_otherwise(monkeypatch):
    """A refusal is the device's state now, not the model's: graphs stay on, and a later step captures."""
    _device_memory(monkeypatch, free=100 << 20)
    auto = _Runner(fallback=True)
    step = _Step()
    assert torch.equal(auto._execute(step), torch.ones(3))  # noqa: SLF001 - the shared step logic under test
    assert auto.mode == "graphs" and auto.failure is None and auto.forgotten == 0 and step.graph is None
    assert dict(auto.stats) == {"steps": 1, "capture_refusals": 1}
    with pytest.raises(RuntimeError, match="100 MiB"):
        _Runner(fallback=False)._execute(_Step())  # noqa: SLF001


class _FakeCuda:
    """The torch.cuda calls capture_step makes, on a CPU, with torch's behaviour where a capture fails: the graph
    context's exit ends the capture first (which raises after an error inside it), so it neither restores the
    thread's stream nor stops the allocator routing to the graph's pool (torch 2.11-2.13, torch/cuda/graphs.py)."""

    def __init__(self, monkeypatch):
        self.default = None  # set below, once Stream exists
        self.current = None
        self.devices: list[torch.device] = []
        self.modes: list[str] = []
        self.pools_capturing: list[object] = []
        fake = self
        _device_memory(monkeypatch, free=8 << 30)

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.previous, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.previous

        class DeviceContext:
            def __init__(self, device):
                fake.devices.append(device)

            def __enter__(self):
                pass

            def __exit__(self, *exc):
                pass

        class Graph:
            def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
                self.pool, self.stream_ctx = pool, StreamContext(stream)
                fake.modes.append(capture_error_mode)

            def __enter__(self):
                self.stream_ctx.__enter__()
                fake.pools_capturing.append(self.pool)

            def __exit__(self, *exc):
                if exc[0] is not None:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
                fake.pools_capturing.remove(self.pool)
                self.stream_ctx.__exit__(*exc)

        def end_allocate_to_pool(index, pool):
            if pool not in fake.pools_capturing:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            fake.pools_capturing.remove(pool)

        self.default = self.current = Stream()
        for name, value in {"device": DeviceContext, "current_stream": lambda device=None: fake.current,
                            "Stream": Stream, "stream": StreamContext, "CUDAGraph": object, "graph": Graph,
                            "graph_pool_handle": lambda: (0, 7), "current_device": lambda: 0,
                            "set_stream": lambda stream: setattr(fake, "current", stream)}.items():
            monkeypatch.setattr(torch.cuda, name, value, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate_to_pool, raising=False)


def test_a_failed_capture_leaves_the_threads_stream_and_the_allocator_as_they_were(monkeypatch):
    """After a failed capture (a model with a host sync, e.g. MoE routing) auto mode runs eagerly: on the stream it
    ran on before, not on the dead capture's stream, and with the allocator out of capture mode (else it stops
    recycling memory used across streams)."""
    cuda = _FakeCuda(monkeypatch)
    calls = []

    def step():
        calls.append(cuda.current)
        if len(calls) == 2:  # the warm-up run passes; inside the capture the step syncs with the host
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.ones(1)

    with pytest.raises(CaptureFailed, match="previous error during capture"):
        capture_step(step, torch.device("cuda", 1))
    assert cuda.current is cuda.default and cuda.pools_capturing == []
    assert cuda.devices == [torch.device("cuda", 1)] and cuda.modes == ["thread_local"]
    assert calls[0] is calls[1] is not cuda.default  # warm-up and capture on a stream of the capture's own


def test_a_capture_that_succeeds_is_left_to_torch(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    graph, out = capture_step(lambda: torch.ones(2), torch.device("cuda", 0))
    assert torch.equal(out, torch.ones(2)) and cuda.current is cuda.default and cuda.pools_capturing == []


def test_a_failed_capture_on_a_gpu_restores_the_threads_stream(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    x = torch.ones(4, device=device)
    before = torch.cuda.current_stream(device)
    with pytest.raises(CaptureFailed):
        capture_step(lambda: x * float(x.sum().item()), device)  # .item() syncs with the host: not capturable
    assert torch.cuda.current_stream(device) == before
    graph, out = capture_step(lambda: x * 2, device)  # graphs still capture afterwards
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out.cpu(), torch.full((4,), 6.0))
