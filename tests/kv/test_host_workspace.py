"""Host workspaces (kv/host_workspace.py) and forwards over them (kv/host_stream.py, model/streamed_forward.py):
a sequence whose K/V lives in host memory runs with exactly the outputs of the same forwards over a resident
KVWorkspace, whether attention reads the host buffers (CPU) or the K/V is staged through device buffers a layer
ahead (CUDA's path; run on a CPU with copies that complete as issued)."""
from __future__ import annotations

import pytest
import torch

from kvboost import KVBoost
from kvboost.kv import host_workspace
from kvboost.kv.host_workspace import HostWorkspace, copy_heads
from kvboost.kv.workspace import KVWorkspace, LayerShape
from kvboost.model.forward import forward_tokens, probe_layer_shapes, resolve_attention
from kvboost.model.streamed_forward import streamed_forward
from kvboost.results import GenerationMode

from ..prompts import text_with_tokens
from ..tiny_models import TINY_ARCHS, make_tiny_model

CHUNK = 16
RESIDENT_POSITIONS = 24  # "staged+resident": positions kept on the device (the prompts below are longer)
MODES = ["host", "staged", "staged+resident"]


def _host(model, mode: str) -> HostWorkspace:
    """A host workspace for `model`: attention over host memory ("host", CPU only), or staged through device
    buffers, with or without the first RESIDENT_POSITIONS positions kept on the device."""
    device = next(model.parameters()).device
    if mode == "host" and device.type != "cpu":
        pytest.skip("attention reads host memory only where the model runs on the host")
    shapes, dtype = probe_layer_shapes(model)
    resident = RESIDENT_POSITIONS * _per_position(shapes, dtype) if mode == "staged+resident" else 0
    return HostWorkspace(shapes, dtype, device, resident_bytes=resident, staged=mode != "host")


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _per_position(shapes: list[LayerShape], dtype: torch.dtype) -> int:
    """Bytes of one position's K and V, every layer."""
    return sum(s.kv_heads * (s.head_dim_k + s.head_dim_v) for s in shapes) * dtype.itemsize


class Resident:
    """The reference: the same forwards over a KVWorkspace (the engine's resident path)."""

    def __init__(self, model, capacity: int, attention: str = "model"):
        self.model, self.attention = model, attention
        shapes, dtype = probe_layer_shapes(model)
        self.ws = KVWorkspace(shapes, dtype, next(model.parameters()).device)
        self.ws.ensure_capacity(capacity, keep=0)

    def forward(self, tokens: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        n = len(tokens)
        with torch.no_grad():  # as streamed_forward (and the engine)
            logits = forward_tokens(self.model, tokens, self.ws.make_cache(start),
                                    logits_to_keep=n if all_logits else 1, attention=self.attention)
        return logits[0] if all_logits else logits[0, -1]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.device.type == "cpu":  # fp32 on a CPU: bit for bit
        assert torch.equal(got, want)
    else:  # the staged path's views have other strides than the workspace's: kernels may round differently
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _ids(tokenizer, n: int, seed: int) -> list[int]:
    return tokenizer(text_with_tokens(tokenizer, n, seed=seed))["input_ids"][:n]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_and_decode_equal_the_resident_workspace(tokenizer, device, arch, mode):
    model = make_tiny_model(arch, tokenizer)
    ids = _ids(tokenizer, 40, seed=1)
    host, resident = _host(model, mode), Resident(model, 64)
    got, want = streamed_forward(model, host, ids, 0), resident.forward(ids, 0)
    _same(got, want)
    for step in range(20):  # greedy on the reference's logits: both see the same tokens
        token = int(want.argmax())
        pos = len(ids) + step
        got, want = streamed_forward(model, host, [token], pos), resident.forward([token], pos)
        _same(got, want)
    assert host.length == len(ids) + 20 and host.stats.forwards == 21
    if mode == "staged+resident":
        assert host.resident.filled == RESIDENT_POSITIONS


@pytest.mark.parametrize("mode", MODES)
def test_a_rejected_verify_rolls_back_and_decoding_goes_on(tokenizer, device, mode):
    model = make_tiny_model("llama", tokenizer)
    ids = _ids(tokenizer, 30, seed=2)
    host, resident = _host(model, mode), Resident(model, 64)
    _same(streamed_forward(model, host, ids, 0), resident.forward(ids, 0))
    drafts = _ids(tokenizer, 6, seed=3)
    start = len(ids)
    _same(streamed_forward(model, host, drafts, start, all_logits=True), resident.forward(drafts, start, True))
    assert host.length == start + len(drafts)
    host.set_length(start + 2)  # two drafts accepted; the rest of their K/V must never be read again
    pos, tokens = start + 2, _ids(tokenizer, 5, seed=4)  # other tokens than the rejected drafts
    for token in tokens:
        _same(streamed_forward(model, host, [token], pos), resident.forward([token], pos))
        pos += 1
    # A verify of several tokens right after a rollback below the resident capacity too.
    _same(streamed_forward(model, host, tokens, 20, all_logits=True), resident.forward(tokens, 20, True))


@pytest.mark.parametrize("mode", MODES)
def test_placed_chunks_continue_like_a_full_prefill(tokenizer, device, mode):
    model = make_tiny_model("qwen2", tokenizer)
    engine = KVBoost(model, tokenizer, chunk_size=CHUNK)
    first = _ids(tokenizer, 5 * CHUNK + 3, seed=5)
    host_a = _host(model, mode)
    streamed_forward(model, host_a, first, 0)
    new, _ = engine.kv.write_back(first, None, host_a)  # stored from host memory (read())
    assert new == 6
    second = first[:4 * CHUNK + 7] + _ids(tokenizer, 9, seed=6)
    plan = engine.kv.lookup(second, None, GenerationMode.CHUNK_KV_REUSE)
    assert plan.reuse_len == 4 * CHUNK + 7
    host_b, resident = _host(model, mode), Resident(model, 128)
    host_b.ensure_capacity(len(second) + 8, keep=0)
    engine.kv.place(plan, host_b, second)
    engine.kv.place(plan, resident.ws, second)
    host_b.set_length(plan.reuse_len)
    suffix = second[plan.reuse_len:]
    got, want = streamed_forward(model, host_b, suffix, plan.reuse_len), resident.forward(suffix, plan.reuse_len)
    _same(got, want)  # the same placement and forwards as the resident engine's: the same bits
    full = Resident(model, 128).forward(second, 0)  # a full prefill rounds differently, within float error
    assert torch.allclose(got, full, atol=1e-4) and int(got.argmax()) == int(full.argmax())
    pos = len(second)
    for _ in range(5):
        token = int(want.argmax())
        got, want = streamed_forward(model, host_b, [token], pos), resident.forward([token], pos)
        _same(got, want)
        pos += 1


def test_read_returns_what_was_written_and_growth_keeps_it(device):
    shapes = [LayerShape(2, 4, 4), LayerShape(3, 8, 6)]  # layers may differ
    host = HostWorkspace(shapes, torch.float32, device)
    host.ensure_capacity(20, keep=0)
    assert host.capacity == 256 and host.device.type == "cpu"
    keys = [torch.randn(s.kv_heads, 12, s.head_dim_k, device=device) for s in shapes]
    values = [torch.randn(s.kv_heads, 12, s.head_dim_v, device=device) for s in shapes]
    for i in range(2):  # in pieces (as place() writes runs of chunks), from the device
        host.write_layer(i, [keys[i][:, :5], keys[i][:, 5:]], [values[i][:, :5], values[i][:, 5:]], start=3)
    got_k, got_v = host.read(3, 15)
    assert all(k.device.type == "cpu" for k in got_k + got_v)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(got_k + got_v, keys + values))
    got_k[0].zero_()  # an owned copy
    assert torch.equal(host.read(3, 15)[0][0], keys[0].cpu())
    host.write([-k[None, :, :4] for k in keys], [-v[None, :, :4] for v in values], start=0, n_tokens=2)  # 4D, cut
    assert torch.equal(host.read(0, 2)[1][1], -values[1][:, :2].cpu())
    assert torch.equal(host.read(3, 15)[1][1], values[1].cpu())  # untouched
    host.set_length(15)
    host.ensure_capacity(300)  # growth keeps every position held
    assert host.capacity >= 300 and host.length == 15 and torch.equal(host.read(3, 15)[1][1], values[1].cpu())
    host.ensure_capacity(900, keep=5)
    assert host.length == 5 and torch.equal(host.read(0, 2)[0][1], -keys[1][:, :2].cpu())
    with pytest.raises(ValueError, match="one sequence"):
        host.read(0, 2, row=1)
    with pytest.raises(ValueError, match="exceed"):
        host.write_layer(0, [keys[0]], [values[0]], start=host.capacity - 4)
    host.release()
    assert host.nbytes == 0 and host.capacity == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_forward_that_raises_midway_leaves_the_sequence_at_its_old_length(tokenizer, device, mode, monkeypatch):
    model = make_tiny_model("llama", tokenizer)
    ids = _ids(tokenizer, 20, seed=7)
    host, resident = _host(model, mode), Resident(model, 64)
    # The prompt's K/V is placed (not computed here): no position is on the device yet, so the failing forward
    # brings them all and keeps them on the device in the layers that ran before the failure.
    donor = _host(model, "staged")
    streamed_forward(model, donor, ids, 0)
    host.ensure_capacity(64, keep=0)
    host.write(*donor.read(0, len(ids)), start=0)
    host.set_length(len(ids))
    resident.forward(ids, 0)
    layer = model.model.layers[1]

    def failing(*args, **kwargs):
        raise RuntimeError("layer 1 failed")

    monkeypatch.setattr(layer, "forward", failing)
    with pytest.raises(RuntimeError, match="layer 1 failed"):  # layer 0 wrote this step's K/V, layer 1 raised
        streamed_forward(model, host, [17, 18, 19], len(ids))
    monkeypatch.undo()
    assert host.length == len(ids) and host.stats.forwards == 0
    if mode == "staged+resident":
        assert host.resident.filled == 0  # layers 1 and 2 kept nothing
    pos = len(ids)
    for tokens in ([5], [6, 7], [8]):  # other tokens at the failed step's positions
        _same(streamed_forward(model, host, tokens, pos), resident.forward(tokens, pos))
        pos += len(tokens)


def test_counters_count_what_crosses(tokenizer, device):
    model = make_tiny_model("llama", tokenizer)
    shapes, dtype = probe_layer_shapes(model)
    per_position = _per_position(shapes, dtype)
    ids = _ids(tokenizer, 40, seed=8)
    staged, kept = _host(model, "staged"), _host(model, "staged+resident")
    for host in (staged, kept):
        streamed_forward(model, host, ids, 0)
        assert host.stats.bytes_to_device == 0  # a prefill from position 0 reads nothing earlier
        assert host.stats.bytes_to_host == 40 * per_position
        streamed_forward(model, host, [3, 4], 40)
        streamed_forward(model, host, [5], 42)
        assert host.stats.forwards == 3 and host.stats.bytes_to_host == 43 * per_position
    assert staged.stats.bytes_to_device == (40 + 42) * per_position  # every earlier position, every step
    # The resident positions (the first 24: kept by the prefill) do not cross again.
    assert kept.stats.bytes_to_device == (40 - 24 + 42 - 24) * per_position
    assert _bytes(*sum(kept.scratch.flat, ())) == _bytes(*sum(staged.scratch.flat, ())) and staged.resident is None
    assert _bytes(*kept.resident.keys, *kept.resident.values) == RESIDENT_POSITIONS * per_position
    if device.type == "cpu":  # attention over host memory: nothing crosses
        host = _host(model, "host")
        streamed_forward(model, host, ids, 0)
        streamed_forward(model, host, [3], 40)
        assert host.stats.forwards == 2 and host.stats.bytes_to_device == host.stats.bytes_to_host == 0
        assert host.scratch is None and host.resident is None and not host.pinned


def test_copy_heads_copies_a_range_of_positions_of_every_head(device):
    src = torch.randn(1, 3, 50, 8)
    dst = torch.zeros(1, 3, 20, 8, device=device)
    copy_heads(dst[0, :, 4:14], src[0, :, 30:40])
    copy_heads(dst[0, :, 0:0], src[0, :, 0:0])  # nothing to copy
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert torch.equal(dst[0, :, 4:14].cpu(), src[0, :, 30:40]) and not dst[0, :, :4].any()
    back = torch.zeros(1, 3, 50, 8)
    copy_heads(back[0, :, 30:40], dst[0, :, 4:14])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert torch.equal(back[0, :, 30:40], src[0, :, 30:40]) and not back[0, :, :30].any()


# ---- CUDA: pinned buffers, the side stream, cudaMemcpy2DAsync ----------------------------------------------
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream prefetch path needs CUDA")


@cuda_only
def test_cuda_buffers_are_pinned_and_head_ranges_cross_in_one_strided_copy():
    shapes = [LayerShape(4, 16, 16)] * 2
    host = HostWorkspace(shapes, torch.bfloat16, torch.device("cuda"))
    host.ensure_capacity(100, keep=0)
    assert host.staged and host.pinned and host.pageable_reason is None
    assert host.buffers(0)[0].is_pinned()
    src = torch.randn(4, 60, 16, dtype=torch.bfloat16, device="cuda")
    host.write_layer(1, [src[:, :30], src[:, 30:]], [src, ], start=10)
    assert torch.equal(host.read(10, 70)[1][1], src.cpu())
    dst = torch.zeros(1, 4, 80, 16, dtype=torch.bfloat16, device="cuda")
    copy_heads(dst[0, :, 5:65], host.buffers(1)[0][0, :, 10:70])
    torch.cuda.synchronize()
    assert torch.equal(dst[0, :, 5:65], src)
    status = host_workspace._strided.status
    assert status == "one cudaMemcpy2DAsync per layer and K/V", status


@cuda_only
@pytest.mark.parametrize("resident_positions", [0, 100])
def test_cuda_side_stream_prefetch_equals_the_resident_run_in_bf16(tokenizer, resident_positions):
    """Long enough that copies take real time: a layer read before its copy landed, or a scratch buffer overwritten
    while attention still read it, would show in the logits."""
    model = make_tiny_model("llama", tokenizer, device=torch.device("cuda"), num_hidden_layers=6).to(torch.bfloat16)
    shapes, dtype = probe_layer_shapes(model)
    host = HostWorkspace(shapes, dtype, torch.device("cuda"), resident_bytes=resident_positions
                         * _per_position(shapes, dtype))
    resident = Resident(model, 1024)
    ids = (_ids(tokenizer, 300, seed=9) * 3)[:800]
    got, want = streamed_forward(model, host, ids, 0), resident.forward(ids, 0)
    for step in range(12):
        assert int(got.argmax()) == int(want.argmax())
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)
        token = int(want.argmax())
        got, want = streamed_forward(model, host, [token], 800 + step), resident.forward([token], 800 + step)
    per_position = _per_position(shapes, dtype)
    assert host.pinned and host.stats.bytes_to_host == 812 * per_position
    crossed = sum(800 + s - resident_positions for s in range(12))
    assert host.stats.bytes_to_device == crossed * per_position


def test_positions_placed_into_a_reused_host_workspace_replace_its_device_copies(tokenizer, device):
    """A host workspace that held another sequence, with its first positions kept on the device: positions placed
    there (write / write_layer) must be read from the host, never from the stale device copy."""
    model = make_tiny_model("llama", tokenizer)
    old, new = _ids(tokenizer, 40, seed=10), _ids(tokenizer, 40, seed=11)
    donor, host = _host(model, "staged"), _host(model, "staged+resident")
    streamed_forward(model, host, old, 0)
    assert host.resident.filled == RESIDENT_POSITIONS
    streamed_forward(model, donor, new, 0)
    keys, values = donor.read(0, 30)
    host.write(keys, values, start=0)  # the new sequence's K/V over the old one's
    host.set_length(30)
    resident = Resident(model, 64)
    resident.forward(new, 0)  # the K/V the donor computed (a 30-token prefill would round differently)
    _same(streamed_forward(model, host, new[30:], 30), resident.forward(new[30:], 30))


@pytest.mark.parametrize("mode", ["host", "staged"])
def test_the_engines_attention_backend_runs_over_the_stream(tokenizer, device, mode):
    model = make_tiny_model("llama", tokenizer)
    attention, _ = resolve_attention("sdpa", model)
    ids = _ids(tokenizer, 30, seed=12)
    host, resident = _host(model, mode), Resident(model, 64, attention)
    _same(streamed_forward(model, host, ids, 0, attention=attention), resident.forward(ids, 0))
    drafts = _ids(tokenizer, 4, seed=13)
    _same(streamed_forward(model, host, drafts, 30, all_logits=True, attention=attention),
          resident.forward(drafts, 30, all_logits=True))
