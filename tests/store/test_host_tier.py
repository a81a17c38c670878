"""The host tier (store/host.py): what the device tier evicts moves to host memory, comes back on a hit, and every key
lives in exactly one of device and host; quantized payloads move unchanged; failed moves are counted, never raised.

On a CPU the "device" tier is RAM too: the tests drive the moves through their logic (the same code, minus the
page-locking and the asynchronous copies, which the `cuda` tests at the end check on a GPU: pytest --device cuda).
"""
from __future__ import annotations

import gc
import random
import threading

import pytest
import torch
from _synth import make_record, same

from kvboost.config import EngineConfig
from kvboost.kv import pinned
from kvboost.kv.long_context import device_kv_budget
from kvboost.store import host as host_tier
from kvboost.store.disk import DiskStore
from kvboost.store.host import HostStore
from kvboost.store.memory import MemoryStore
from kvboost.store.quant import LazyQuantRecord, QuantCodec
from kvboost.store.tiered import TieredStore, build_store

NB = make_record(0).nbytes  # one synthetic record's bytes (4 layers x 2 heads x 16 tokens x 16 dims, fp32)


def tiered(device_records: float, host_records: float, **kw) -> TieredStore:
    """A store whose device tier holds `device_records` records' bytes and whose host tier `host_records`'."""
    return TieredStore(MemoryStore(int(device_records * NB)), host=HostStore(int(host_records * NB)), **kw)


def where(store: TieredStore, key: str) -> set[str]:
    return {t.name for t in store.fast_tiers if t.contains(key)}


def test_device_evictions_move_to_the_host_and_come_back_identical():
    recs = [make_record(i, parent_key="p" if i else None) for i in range(8)]
    store = tiered(3, 5)
    assert all(store.put(r) for r in recs)
    tiers = store.tier_stats()
    assert tiers["memory"].entries == 3 and tiers["memory"].evictions == 5
    assert tiers["host"].entries == 5 and tiers["host"].extra["offloaded"] == 5  # nothing dropped
    assert tiers["host"].bytes == 5 * NB and tiers["host"].extra["failures"] == {}
    assert all(where(store, r.key) in ({"memory"}, {"host"}) for r in recs)
    on_host = [r for r in recs if where(store, r.key) == {"host"}]
    got = store.get(on_host[0].key)
    assert same(got, on_host[0])
    assert where(store, on_host[0].key) == {"memory"}  # promoted: the host copy is gone
    tiers = store.tier_stats()
    assert tiers["host"].promotions == 1 and tiers["host"].hits == 1 and store.stats().promotions == 1
    assert all(same(store.get(r.key), r) for r in recs)  # every record, wherever it moved meanwhile
    assert store.stats().entries == 8 and store.stats().hits == 9


def test_a_host_record_is_one_host_tensor_and_goes_back_in_one_copy():
    store = tiered(1, 4)
    a, b = make_record(0), make_record(1)
    store.put(a)
    store.put(b)  # a moves to the host
    host = store.host.get(a.key)
    packed = host.packed_view()
    assert packed is not None and packed.shape == (4, 2, 2, 16, 16)  # [layers, K/V, heads, tokens, dim]
    assert packed.device.type == "cpu" and packed.is_contiguous() and same(host, a)
    assert all(k.data_ptr() != ak.data_ptr() for k, ak in zip(host.keys, a.keys))  # a copy, not the device's memory
    # Layers of different shapes (no [layers, 2, ...] form): one byte buffer that every tensor is a view of.
    odd = make_record(2)
    odd.values = [torch.randn(2, 16, 8) for _ in odd.values]  # head_dim_v != head_dim_k
    store.host.put(odd)
    back = store.host.get(odd.key)
    storages = {t.untyped_storage().data_ptr() for t in back.keys + back.values}
    assert len(storages) == 1 and same(back, odd)
    payload = store.host.get_payload(odd.key)
    assert payload.nbytes < odd.nbytes + 8 * 64  # exact size, alignment aside
    assert same(payload.to_device(), odd)


def test_host_evictions_go_on_to_disk_and_are_promoted_back(tmp_path):
    recs = [make_record(i, parent_key="p" if i else None) for i in range(8)]
    store = tiered(2, 2, disk=DiskStore(tmp_path, namespace="m"))
    assert all(store.put(r) for r in recs)
    assert store.flush(10)
    tiers = store.tier_stats()
    assert (tiers["memory"].entries, tiers["host"].entries, tiers["disk"].entries) == (2, 2, 4)
    assert tiers["disk"].extra["written_behind"] == 4  # only the host's evictions went down (not write-through)
    assert {m.key for m in store.children("p")} == {r.key for r in recs[1:]}
    assert all(same(store.get(r.key), r) for r in recs)
    assert store.tier_stats()["disk"].promotions >= 4
    store.delete("chunk-3")
    assert not store.contains("chunk-3") and store.get("chunk-3") is None


def test_a_record_larger_than_the_device_budget_lives_on_the_host():
    store = tiered(0, 4)  # device_kv_budget_bytes=0: every stored chunk on the host
    rec = make_record(0)
    assert store.put(rec) and where(store, rec.key) == {"host"}
    got = store.get(rec.key)
    assert same(got, rec) and got.packed_view() is not None  # the host record itself: it cannot be promoted
    assert store.tier_stats()["host"].promotions == 0 and where(store, rec.key) == {"host"}


def test_a_quantized_device_tier_moves_its_payloads_unchanged():
    codec = QuantCodec(8, v_group_size=256)
    recs = [make_record(i, tokens=128, head_dim=64, dtype=torch.float16) for i in range(6)]
    one = codec.encode(recs[0]).nbytes
    store = TieredStore(MemoryStore(2 * one, codec=codec), host=HostStore(10 * one))
    reference = MemoryStore(10 * one, codec=codec)  # the same quantized records, never moved
    for r in recs:
        assert store.put(r) and reference.put(r)
    host = store.tier_stats()["host"]
    assert host.entries == 4 and host.bytes < 4 * one + 4 * 64 * 3 * 8  # the payloads, not full precision
    assert host.bytes < 4 * recs[0].nbytes * 0.6
    on_host = store.host.get(recs[0].key)
    assert isinstance(on_host, LazyQuantRecord) and on_host.payload.keys[0].data.device.type == "cpu"
    for r in recs:  # from the host (promoted) or the device: bit for bit the payload the device tier made
        got, want = store.get(r.key), reference.get(r.key)
        assert isinstance(got, LazyQuantRecord)
        assert all(torch.equal(x, y) for x, y in zip(got.keys + got.values, want.keys + want.values))
    assert store.tier_stats()["host"].promotions >= 4
    # A promoted payload is stored as it came back (one buffer, every tensor a view of it: on a CPU the host's own),
    # not quantized again from its dequantized values (fresh tensors, and error added for nothing).
    store.get(recs[0].key)
    payload = store.memory.get_payload(recs[0].key)
    tensors = [t for e in payload.keys + payload.values for t in (e.data, e.scale, e.zero)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert torch.equal(payload.keys[0].data, reference.get_payload(recs[0].key).keys[0].data)


def test_a_failed_move_is_counted_and_the_record_goes_on_without_the_host(tmp_path, monkeypatch, caplog):
    def no_memory(shape, dtype, pin):
        raise host_tier.HostMoveError("alloc", "out of host memory")

    monkeypatch.setattr(host_tier, "allocate_host", no_memory)
    recs = [make_record(i) for i in range(4)]
    store = tiered(1, 4, disk=DiskStore(tmp_path, namespace="m"))
    assert all(store.put(r) for r in recs)  # nothing raised
    host = store.tier_stats()["host"]
    assert host.entries == 0 and host.extra["failures"] == {"alloc": 3} and host.extra["offloaded"] == 0
    assert "a move failed" in caplog.text and caplog.text.count("a move failed") == 1  # logged once
    assert store.flush(10) and store.tier_stats()["disk"].entries == 3  # spilled past the host instead
    monkeypatch.undo()
    assert all(same(store.get(r.key), r) for r in recs)


def test_a_failed_copy_keeps_nothing_half_made(monkeypatch):
    # A host tensor that refuses in-place writes (a leaf that requires grad) makes every copy into it fail.
    monkeypatch.setattr(host_tier, "allocate_host",
                        lambda shape, dtype, pin: (torch.empty(shape, dtype=dtype, requires_grad=True), None))
    store = tiered(1, 4)
    recs = [make_record(i) for i in range(3)]
    assert all(store.put(r) for r in recs)
    host = store.tier_stats()["host"]
    assert host.entries == 0 and host.extra["failures"] == {"copy_to_host": 2}
    assert [where(store, r.key) for r in recs] == [set(), set(), {"memory"}]  # dropped: no disk behind


def test_a_failed_copy_back_serves_the_host_record(monkeypatch):
    store = tiered(1, 4)
    a, b = make_record(0), make_record(1)
    store.put(a)
    store.put(b)

    def device_full(self):
        raise host_tier.HostMoveError("copy_to_device", "out of device memory")

    monkeypatch.setattr(host_tier.HostPayload, "to_device", device_full)
    got = store.get(a.key)
    assert same(got, a) and where(store, a.key) == {"host"}  # served from the host, kept there
    host = store.tier_stats()["host"]
    assert host.extra["failures"] == {"copy_to_device": 1} and host.promotions == 0


@pytest.mark.parametrize("rc", [0, 2])
def test_page_locking_is_per_record_at_its_exact_size_and_a_refusal_is_reported(monkeypatch, rc):
    class Runtime:
        def __init__(self):
            self.registered: list[int] = []

        def host_register(self, ptr, nbytes):
            self.registered.append(nbytes)
            return rc  # 2: cudaErrorMemoryAllocation (the process's page-lock limit)

        def host_unregister(self, ptr):
            return 0

    runtime = Runtime()
    monkeypatch.setattr(pinned, "cuda_runtime", lambda: runtime)
    store = TieredStore(MemoryStore(NB), host=HostStore(8 * NB, pin=True))
    recs = [make_record(i) for i in range(4)]
    for r in recs:
        store.put(r)
    assert runtime.registered == [NB] * 3  # one registration per moved record, of exactly its bytes
    host = store.tier_stats()["host"].as_dict()
    if rc == 0:
        assert host["pinned"] and host["unpinned_reason"] is None and host["pageable_moves"] == 0
    else:
        assert not host["pinned"] and "error 2" in host["unpinned_reason"] and host["pageable_moves"] == 3
    assert all(same(store.get(r.key), r) for r in recs)  # pageable or not, the same K/V
    gc.collect()


def test_eviction_order_is_lfu_with_aging():
    # Device: 3 records. a is hit twice, c once; b never.
    store = tiered(3, 10)
    a, b, c = (make_record(i) for i in range(3))
    for r in (a, b, c):
        store.put(r)
    store.get(a.key), store.get(a.key), store.get(c.key)
    d = make_record(3)
    store.put(d)
    assert store.host.metas()[-1].key == b.key  # the least used goes first
    e = make_record(4)
    store.put(e)
    assert store.host.metas()[-1].key == d.key  # new d sat at the risen age floor, below c's one hit
    assert store.get(b.key) is not None and store.memory.contains(b.key)  # back on a hit

    # Equal priorities: a chain's tail (deeper start) goes before its older head, then the stalest.
    store = tiered(3, 10)
    head, tail, x = make_record(5, start=0), make_record(6, parent_key="chunk-5", start=16), make_record(7)
    for r in (head, tail, x, make_record(8), make_record(9)):
        store.put(r)
    assert [m.key for m in store.host.metas()] == [tail.key, head.key]


class Reference:
    """The tiered store's device/host policy over plain MemoryStores (LFU with aging, store/memory.py): what the
    host tier must reproduce, key for key, whatever its copies and packing."""

    def __init__(self, device_bytes: int, host_bytes: int):
        self.host = MemoryStore(host_bytes)
        self.device = MemoryStore(device_bytes, on_evict=self.host.put)

    def put(self, r) -> None:
        if self.host.contains(r.key):
            self.host.put(r)
        elif not self.device.put(r):
            self.host.put(r)

    def get(self, key: str) -> None:
        if self.device.get(key) is None:
            r = self.host.get(key)
            if r is not None and r.nbytes <= self.device.budget_bytes:  # a swap: out of the host, then in
                self.host.delete(key)
                assert self.device.put(r)

    def delete(self, key: str) -> None:
        self.device.delete(key)
        self.host.delete(key)


@pytest.mark.parametrize("seed", range(30))
def test_random_traces_keep_every_key_in_exactly_one_tier(seed):
    rng = random.Random(seed)
    # Records of 1-3 sizes under small budgets: most puts and promotions move something.
    pool = []
    for i in range(24):
        parent = pool[rng.randrange(len(pool))] if pool and rng.random() < 0.6 else None
        pool.append(make_record(i, tokens=rng.choice([8, 16, 24]), layers=2, head_dim=8,
                                parent_key=parent.key if parent else None, start=parent.start + 16 if parent else 0,
                                content_key=f"content-{i % 7}"))
    chunk = make_record(0, tokens=16, layers=2, head_dim=8).nbytes
    device_bytes, host_bytes = rng.choice([2, 3, 4]) * chunk, rng.choice([2, 4, 6]) * chunk
    store = TieredStore(MemoryStore(device_bytes), host=HostStore(host_bytes))
    ref = Reference(device_bytes, host_bytes)
    by_key = {r.key: r for r in pool}
    for _ in range(120):
        r = rng.choice(pool)
        op = rng.random()
        if op < 0.45:
            store.put(r)
            ref.put(r)
        elif op < 0.93:
            got = store.get(r.key)
            ref.get(r.key)
            assert got is None or same(got, r)
        else:
            store.delete(r.key)
            ref.delete(r.key)
        for key in by_key:
            assert len(where(store, key)) <= 1, f"{key} in both tiers"
            assert store.memory.contains(key) == ref.device.contains(key), f"{key}: device membership differs"
            assert store.host.contains(key) == ref.host.contains(key), f"{key}: host membership differs"
            assert store.contains(key) == bool(where(store, key))
        assert store.memory.stats().bytes <= device_bytes and store.host.stats().bytes <= host_bytes
        parents = {m.parent_key for m in store.memory.metas() + store.host.metas()} | {None}
        for p in parents:
            assert sorted(m.key for m in store.children(p)) == sorted(
                k for k, rec in by_key.items() if rec.parent_key == p and where(store, k))
        for c in {f"content-{i}" for i in range(7)}:
            assert sorted(m.key for m in store.by_content(c)) == sorted(
                k for k, rec in by_key.items() if rec.content_key == c and where(store, k))


def test_concurrent_puts_and_gets_never_hold_a_key_twice():
    recs = [make_record(i, layers=2, head_dim=8) for i in range(16)]
    nb = recs[0].nbytes
    store = TieredStore(MemoryStore(3 * nb), host=HostStore(5 * nb))
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            r = rng.choice(recs)
            if rng.random() < 0.4:
                store.put(r)
            else:
                got = store.get(r.key)
                if got is not None and not same(got, r):
                    errors.append(r.key)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(len(where(store, r.key)) <= 1 for r in recs)
    assert store.memory.stats().bytes <= 3 * nb and store.host.stats().bytes <= 5 * nb


def test_build_store_and_options():
    cfg = EngineConfig(memory_budget_bytes=10 * NB, device_kv_budget_bytes=2 * NB)  # no paged_kv needed
    store = build_store(cfg, namespace="x", device_budget_bytes=cfg.device_kv_budget_bytes)
    assert store.memory.budget_bytes == 2 * NB and store.host.budget_bytes == 10 * NB
    assert set(store.stats().extra["tiers"]) == {"memory", "host"} and not store.host.mover.pin
    assert build_store(cfg, namespace="x", device_budget_bytes=0, pin_host=True).host.mover.pin
    device_only = build_store(EngineConfig(memory_budget_bytes=0), namespace="x", device_budget_bytes=3 * NB)
    assert device_only.host is None and device_only.memory.budget_bytes == 3 * NB  # host budget 0: no host tier
    plain = build_store(EngineConfig(memory_budget_bytes=10 * NB), namespace="x")
    assert plain.host is None and plain.memory.budget_bytes == 10 * NB
    assert set(plain.stats().extra["tiers"]) == {"memory"}
    cpu = torch.device("cpu")
    assert device_kv_budget(None, cpu) is None and device_kv_budget(5, cpu) == 5  # no host tier by default on CPU
    with pytest.raises(ValueError, match="device_kv_budget_bytes"):
        EngineConfig(device_kv_budget_bytes=-1)


# ---- CUDA: page-locked host copies, asynchronous copies out, blocking copies back ------------------------------------
def test_cuda_records_move_to_page_locked_memory_and_back(device):
    if device.type != "cuda":
        pytest.skip("page-locked host copies of device records need a CUDA device (pytest --device cuda)")
    recs = [make_record(i, device=device) for i in range(4)]
    store = TieredStore(MemoryStore(NB), host=HostStore(8 * NB, pin=True))
    for r in recs:
        store.put(r)
    host = store.tier_stats()["host"].as_dict()
    assert host["offloaded"] == 3 and host["failures"] == {}
    on_host = store.host.get(recs[0].key)
    assert on_host.keys[0].device.type == "cpu"
    assert on_host.packed.is_pinned() if host["pinned"] else host["unpinned_reason"]  # page-locked, or says why not
    got = store.get(recs[0].key)
    assert got.keys[0].device == recs[0].keys[0].device and same(got, recs[0])  # promoted back onto the GPU
    assert all(same(store.get(r.key), r) for r in recs)


def test_cuda_quantized_payloads_move_and_dequantize_alike(device):
    if device.type != "cuda":
        pytest.skip("needs a CUDA device (pytest --device cuda)")
    codec = QuantCodec(8, v_group_size=256)
    recs = [make_record(i, tokens=128, head_dim=64, dtype=torch.float16, device=device) for i in range(4)]
    one = codec.encode(recs[0]).nbytes
    store = TieredStore(MemoryStore(one, codec=codec), host=HostStore(10 * one, pin=True))
    reference = MemoryStore(10 * one, codec=codec)
    for r in recs:
        store.put(r)
        reference.put(r)
    host_only = store.host.get(recs[0].key)  # placed from the host without promotion: dequantized on the CPU
    want = reference.get(recs[0].key)
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(host_only.keys, want.keys))
    for r in recs:
        got = store.get(r.key)
        assert got.payload.keys[0].data.device.type == "cuda"
        assert all(torch.equal(x, y) for x, y in zip(got.keys + got.values, reference.get(r.key).keys +
                                                     reference.get(r.key).values))
