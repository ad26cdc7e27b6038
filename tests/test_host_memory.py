"""The host tier asks for exactly the bytes of its expert blobs (no power-of-two rounding), and releases them."""
from __future__ import annotations

import gc

import pytest
import torch

from dsv3lite.errors import UserError
from dsv3lite.offload.host_memory import pinned_empty

EAGER_STEP = True            # offloaded and capped tokens against resident ones, bit for bit (conftest.py)


def test_requested_bytes_equal_the_data_for_uneven_layer_sizes():
    registered, released = {}, []
    register = lambda ptr, n: registered.__setitem__(ptr, n) or 0
    # per-layer [n_experts, blob_bytes] tiers of uneven sizes, e.g. an MTP layer or a 10.5 GiB V3 FP8 layer shape
    shapes = [(256, 44_040_192 // 1024), (257, 23_199_744 // 512), (3, 4097), (1, 1)]
    tiers = [pinned_empty(s, register, released.append) for s in shapes]
    data = sum(a * b for a, b in shapes)
    assert sum(registered.values()) == data <= 1.01 * data
    assert [t.numel() for t in tiers] == [a * b for a, b in shapes]
    assert sorted(registered) == sorted(t.data_ptr() for t in tiers)
    ptr = tiers[0].data_ptr()
    del tiers[0]
    gc.collect()
    assert released == [ptr]


def test_registration_lasts_while_any_view_of_the_memory_lives():
    # a pinned chunk handed out as rows (host_memory.HotExperts): the rows outlive the chunk's own tensor
    registered, released = {}, []
    chunk = pinned_empty((4, 1000), lambda ptr, n: registered.__setitem__(ptr, n) or 0, released.append)
    rows = [chunk[i] for i in range(4)]
    ptr = chunk.data_ptr()
    del chunk
    gc.collect()
    assert released == []                        # the rows still read pinned memory
    rows[2].fill_(7)
    assert int(rows[2].sum()) == 7000
    del rows
    gc.collect()
    assert released == [ptr] and registered == {ptr: 4000}


def test_allocations_never_share_a_page():
    import mmap

    registered = []
    small = [pinned_empty((n,), lambda ptr, size: registered.append((ptr, size)) or 0, lambda ptr: 0)
             for n in (3, 5, 4096, 4097, 1)]
    pages = [set(range(p // mmap.PAGESIZE, (p + n - 1) // mmap.PAGESIZE + 1)) for p, n in registered]
    assert all(p % mmap.PAGESIZE == 0 for p, _ in registered)
    assert all(not (a & b) for i, a in enumerate(pages) for b in pages[i + 1:])
    assert [t.numel() for t in small] == [3, 5, 4096, 4097, 1]


def test_registration_is_portable(monkeypatch):
    from types import SimpleNamespace

    from dsv3lite.offload import host_memory

    calls = []
    fake = SimpleNamespace(cudaHostRegister=lambda ptr, n, flags: calls.append(flags) or 0,
                           cudaHostUnregister=lambda ptr: 0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pinned_empty((2, 64))
    assert calls == [host_memory.CUDA_HOST_REGISTER_PORTABLE] == [1]       # cudaHostRegisterPortable


def test_cgroup_memory_limits_are_read_from_the_tightest_level(tmp_path):
    from dsv3lite.offload.host_memory import cgroup_memory

    def write(path, **files):
        path.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (path / name.replace("_", ".", 1)).write_text(text + "\n")

    v2 = tmp_path / "v2"
    write(v2, memory_max="max", memory_current="5000")
    write(v2 / "user" / "job", memory_max="8000000000", memory_current="6000000000")     # 2 GB left
    write(v2 / "user" / "job" / "step", memory_max="max", memory_current="100")
    write(v2 / "user", memory_max="16000000000", memory_current="6500000000")          # 9.5 GB left
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user/job/step\n")
    assert cgroup_memory(str(proc), str(v2)) == (8_000_000_000, 6_000_000_000)
    proc.write_text("0::/\n")
    assert cgroup_memory(str(proc), str(v2)) is None                                   # no limit at the root
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "docker" / "abc", memory_limit_in_bytes="4294967296", memory_usage_in_bytes="1073741824")
    write(v1 / "memory", memory_limit_in_bytes="9223372036854771712", memory_usage_in_bytes="1")   # unlimited
    proc.write_text("12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc\n")
    assert cgroup_memory(str(proc), str(v1)) == (4294967296, 1073741824)
    assert cgroup_memory(str(tmp_path / "none"), str(v1)) is None


def test_host_ram_budget_keeps_a_reserve_and_the_cgroup_limit(monkeypatch):
    from types import SimpleNamespace

    import psutil

    from dsv3lite.offload.host_memory import HOST_RESERVE_MIN, host_ram_budget, host_reserve

    gib = 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=900 * gib, total=1024 * gib))
    assert host_ram_budget(cgroup=(2**62, 0)) == 900 * gib - 64 * gib             # 1/16 of a 1 TiB machine
    assert host_ram_budget(cgroup=(100 * gib, 40 * gib)) == 60 * gib - 100 * gib // 16   # the container's room
    assert host_reserve(16 * gib) == HOST_RESERVE_MIN == 2 * gib                    # at least 2 GiB


def test_a_failed_registration_is_one_clear_line():
    with pytest.raises(UserError, match="cannot pin .* host memory"):
        pinned_empty((4, 1024), lambda ptr, n: 2, lambda ptr: 0)


def test_background_pinning_swaps_layers_while_serving_and_tokens_do_not_change(tmp_path, monkeypatch):
    """The pinner copies each mapped layer into new memory (here plain memory standing in for pinned) and swaps it
    in while the engine decodes; outputs stay those of the mapped tier and the stats count the pinned bytes."""
    import dsv3lite
    from dsv3lite import expert_cache_dir
    from dsv3lite.offload.host_memory import BackgroundPinner
    from dsv3lite.testing import offload_budget, write_checkpoint

    monkeypatch.setenv(expert_cache_dir.ENV, str(tmp_path / "cache"))
    path = write_checkpoint(tmp_path / "m", "v3")
    kw = dict(device="cpu", experts="int4", ctx_size=128, mtp=False, progress=False, log=lambda m: None)
    resident = dsv3lite.load(path, **kw)
    resident.stop_ids = set()
    expected = [c.token_id for c in resident.generate("pin me", max_tokens=12)]
    llm = dsv3lite.load(path, gpu_mem=offload_budget(path, 8, "int4", ctx=128, mtp=False), miss_policy="cpu", **kw)
    llm.stop_ids = set()
    rt = llm.offload
    assert rt.host.mode == "mmap" and rt.stats()["host_pinned_bytes"] == 0
    layers = sorted(rt.host.layers)
    before = {l: rt.host.layers[l].data_ptr() for l in layers}
    gate = __import__("threading").Event()

    def pin(shape):
        gate.wait(10)                      # the first layer waits until decoding has started
        return torch.empty(shape, dtype=torch.uint8)

    tokens = []
    for i, c in enumerate(llm.generate("pin me", max_tokens=12)):
        tokens.append(c.token_id)
        if i == 0:
            pinner = BackgroundPinner(rt.host, layers, pin=pin)
            gate.set()
        if i == 5:
            pinner.join(30)
    assert tokens == expected
    assert all(rt.host.layers[l].data_ptr() != before[l] for l in layers)      # every layer swapped
    s = rt.stats()
    assert s["host_tier"] == "pinned" and s["host_pinned_bytes"] == sum(rt.host.layers[l].numel() for l in layers)
    assert s["cpu_experts"] > 0                       # misses computed from the host blobs, swapped ones included


def test_background_pinning_stops_at_a_failure_with_one_line():
    from dsv3lite.errors import UserError
    from dsv3lite.offload.cache import HostStore
    from dsv3lite.offload.host_memory import BackgroundPinner

    host = HostStore({1: torch.zeros(2, 64, dtype=torch.uint8), 2: torch.ones(2, 64, dtype=torch.uint8)}, 64, "mmap")
    calls, lines = [], []

    def pin(shape):
        calls.append(shape)
        if len(calls) == 2:
            raise UserError("cannot pin 0.00 GiB of host memory (CUDA error 2): lower --cpu-mem or free host RAM")
        return torch.empty(shape, dtype=torch.uint8)

    p = BackgroundPinner(host, [1, 2], pin=pin, log=lines.append)
    p.join(10)
    assert host.pinned_layers == {1} and host.mode == "mmap, 1 of 2 layers pinned"
    assert len(lines) == 1 and "background pinning stopped after 1 layer:" in lines[0]
    assert torch.equal(host.layers[1], torch.zeros(2, 64, dtype=torch.uint8))


def _int4_checkpoint(tmp_path, monkeypatch):
    """(checkpoint path, load keywords, its resident int4 engine, blob bytes): a tiny V3 with int4 experts served
    from an expert cache under tmp_path, CPU."""
    import dsv3lite
    from dsv3lite import expert_cache_dir
    from dsv3lite.testing import write_checkpoint

    monkeypatch.setenv(expert_cache_dir.ENV, str(tmp_path / "cache"))
    path = write_checkpoint(tmp_path / "m", "v3")
    kw = dict(device="cpu", experts="int4", ctx_size=128, mtp=False, progress=False, log=lambda m: None)
    resident = dsv3lite.load(path, **kw)
    resident.stop_ids = set()
    blob = next(m for m in resident.model.modules() if hasattr(m, "blobs")).blobs.shape[1]
    return path, kw, resident, blob


# --- --cpu-mem below the tier: the most used experts pinned (CUDA), resident pages bounded (CPU) -----------------

def _mapped_store(n_layers=2, n_experts=4, blob=64):
    from dsv3lite.offload.cache import HostStore

    layers = {l: torch.arange(n_experts * blob, dtype=torch.int64).add(l).remainder(251).to(torch.uint8)
              .view(n_experts, blob) for l in range(1, n_layers + 1)}
    return HostStore(layers, blob, "mmap")


def test_hot_experts_pin_the_most_used_up_to_the_cap_and_reuse_rows_only_after_the_fence():
    from dsv3lite.offload.host_memory import HotExperts

    host = _mapped_store()
    events, shapes = [], []

    def fence():
        events.append("fence recorded")
        return lambda: events.append("fence waited")

    def pin(shape):
        shapes.append(shape)
        return torch.empty(shape, dtype=torch.uint8)

    hot = HotExperts(host, capacity=3, fence=fence, pin=pin, chunk_rows=2)
    hot.update({(1, 0): 5, (1, 1): 4, (2, 3): 3, (2, 0): 1})
    hot.join()
    assert set(host.hot) == {(1, 0), (1, 1), (2, 3)} and events == []      # nothing freed: no fence needed
    assert sum(s[0] for s in shapes) == 3                                  # rows allocated up to the cap only
    for (l, e), row in host.hot.items():
        assert torch.equal(host.blob((l, e)), host.layers[l][e]) and host.blob((l, e)).data_ptr() == row.data_ptr()
    assert host.pinned_bytes == 3 * 64 and host.mode == "mmap, 3 most used experts pinned"
    assert host.addresses(2)[3] == host.hot[(2, 3)].data_ptr() and host.addresses(2)[0] == host.layers[2][0].data_ptr()

    row_of_11 = host.hot[(1, 1)].data_ptr()
    hot.update({(2, 1): 20, (2, 2): 20})     # scores decay by half per prompt: (1, 0) 2.5 stays, the rest change
    assert (1, 1) not in host.hot and (2, 3) not in host.hot                # served from the map at once
    assert host.blob((1, 1)).data_ptr() == host.layers[1][1].data_ptr()
    hot.join()
    assert set(host.hot) == {(2, 1), (2, 2), (1, 0)}
    assert events == ["fence recorded", "fence waited"] and sum(s[0] for s in shapes) == 3   # freed rows reused
    assert row_of_11 in {r.data_ptr() for r in host.hot.values()}
    assert all(torch.equal(host.hot[k], host.layers[k[0]][k[1]]) for k in host.hot)
    hot.close()


def test_hot_experts_stop_at_a_pin_failure_with_one_line_and_keep_serving():
    from dsv3lite.offload.host_memory import HotExperts

    host = _mapped_store()
    lines = []

    def pin(shape):
        raise UserError("cannot pin 0.00 GiB of host memory (CUDA error 2): lower --cpu-mem or free host RAM")

    hot = HotExperts(host, capacity=2, pin=pin, log=lines.append)
    hot.update({(1, 0): 1})
    hot.join()
    assert host.hot == {} and len(lines) == 1 and "pinning the most used experts stopped" in lines[0]
    hot.update({(1, 1): 1})                 # no more attempts, no hang
    hot.join()
    assert torch.equal(host.blob((1, 0)), host.layers[1][0])


def test_offloaded_tokens_do_not_change_while_the_most_used_experts_are_pinned(tmp_path, monkeypatch):
    import dsv3lite
    from dsv3lite.offload.host_memory import HotExperts
    from dsv3lite.testing import offload_budget

    path, kw, resident, _ = _int4_checkpoint(tmp_path, monkeypatch)
    prompts = ["hot experts", "a second prompt, longer than the first one"]
    expected = [[c.token_id for c in resident.generate(p, max_tokens=8)] for p in prompts]
    llm = dsv3lite.load(path, gpu_mem=offload_budget(path, 8, "int4", ctx=128, mtp=False), miss_policy="cpu", **kw)
    llm.stop_ids = set()
    rt = llm.offload
    rt.hot = HotExperts(rt.host, capacity=5, pin=lambda shape: torch.empty(shape, dtype=torch.uint8))
    got = []
    for p in prompts:
        got.append([c.token_id for c in llm.generate(p, max_tokens=8)])
        rt.hot.join()
        assert len(rt.host.hot) == 5
    assert got == expected
    s = rt.stats()
    assert s["host_pinned_bytes"] == 5 * rt.host.blob_bytes and s["host_tier"] == "mmap, 5 most used experts pinned"
    assert s["cpu_experts"] > 0


def _rss_file() -> int:
    """The process's resident pages of mapped files."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile")


def test_resident_cap_bounds_the_mapped_blobs_resident_pages(tmp_path):
    """Reading 32 blobs of 2 MiB from a private file mapping: without a cap the process keeps all 64 MiB of mapped
    pages resident; with a 12 MiB cap the least recently used are dropped and the growth stays near the cap."""
    import numpy as np

    from dsv3lite.offload.host_memory import ResidentCap

    blob, n = 2 << 20, 32
    f = tmp_path / "blobs.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, n * blob, dtype=np.uint8).tobytes())

    def read_all(cap):
        blobs = torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="c", shape=(n, blob)))
        before = _rss_file()
        sums = []
        for e in range(n):
            if cap is not None:
                cap.touch((blobs[e].data_ptr(),))
            sums.append(int(blobs[e][::512].sum()))       # every page read
        grown = _rss_file() - before
        return grown, sums

    free_growth, free_sums = read_all(None)
    cap = ResidentCap(12 << 20, blob)
    capped_growth, capped_sums = read_all(cap)
    assert capped_sums == free_sums                        # dropped pages read back the same bytes
    assert free_growth > 48 << 20
    assert capped_growth < (12 << 20) + (4 << 20) and cap.dropped == n - 6 and cap.resident <= 12 << 20


def test_host_tier_follows_cpu_mem_and_host_ram(monkeypatch):
    """What the tier does per device, --cpu-mem and RAM (decided without a GPU: nothing here touches CUDA)."""
    from types import SimpleNamespace

    import psutil

    from dsv3lite.offload import setup

    blob, layers, n = 1 << 20, [1, 2, 3], 8
    total = len(layers) * n * blob

    def source(mapped):
        return SimpleNamespace(mapped=mapped, layout=SimpleNamespace(blob_bytes=blob), fmt=SimpleNamespace(name="int4"),
                               layer_blobs=lambda l: torch.zeros(n, blob, dtype=torch.uint8))

    from dsv3lite.offload import host_memory

    reserve = host_memory.HOST_RESERVE_MIN
    ram = SimpleNamespace(available=reserve + 10 * total, total=16 * reserve)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: ram)
    monkeypatch.setattr(host_memory, "cgroup_memory", lambda: None)
    cuda, cpu, log = torch.device("cuda"), torch.device("cpu"), []
    t = setup.host_tier(source(True), layers, cuda, total, None, log.append)
    assert t.pin_layers and t.mode == "mmap" and not t.hot_capacity
    t = setup.host_tier(source(True), layers, cuda, total, 5 * blob + 1, log.append)
    assert not t.pin_layers and t.hot_capacity == 5 and "the 5 most used experts (5.00 MiB) pinned" in log[-1]
    ram.available = reserve + 3 * blob                                     # RAM, not the cap, is what limits
    t = setup.host_tier(source(True), layers, cuda, total, 5 * blob, log.append)
    assert t.hot_capacity == 3 and "host RAM allows 3.00 MiB" in log[-1]
    t = setup.host_tier(source(True), layers, cuda, total, None, log.append)
    assert not t.pin_layers and not t.hot_capacity and "--cpu-mem SIZE pins the most used" in log[-2]
    t = setup.host_tier(source(True), layers, cpu, total, 4 * blob, log.append)
    assert t.resident_cap is not None and t.resident_cap.cap == 4 * blob and "bounds their resident pages" in log[-1]
    assert setup.host_tier(source(True), layers, cpu, total, None, log.append).resident_cap is None
    with pytest.raises(UserError, match=r"--cpu-mem 4.00 MiB is below the 24.00 MiB of int4 expert blobs this run "
                                        r"packs in memory: let the expert cache serve them"):
        setup.host_tier(source(False), layers, cpu, total, 4 * blob, log.append)
    t = setup.host_tier(source(False), layers, cpu, total, total, log.append)
    assert t.mode == "memory" and len(t.blobs) == 3


def test_cpu_mem_on_the_cpu_bounds_the_mapped_experts_and_tokens_do_not_change(tmp_path, monkeypatch):
    import dsv3lite
    from dsv3lite.testing import offload_budget

    path, kw, resident, blob = _int4_checkpoint(tmp_path, monkeypatch)
    expected = [c.token_id for c in resident.generate("bounded pages", max_tokens=10)]
    lines = []
    llm = dsv3lite.load(path, gpu_mem=offload_budget(path, 8, "int4", ctx=128, mtp=False), miss_policy="cpu",
                        cpu_mem=6 * blob, **{**kw, "log": lines.append})
    llm.stop_ids = set()
    assert [c.token_id for c in llm.generate("bounded pages", max_tokens=10)] == expected
    cap = llm.offload.host.resident_cap
    assert cap.dropped > 0 and cap.resident <= 6 * blob
    assert any("bounds their resident pages" in line for line in lines)


def test_cpu_mem_bounds_resident_experts_on_the_cpu(tmp_path, monkeypatch):
    """Nothing offloaded, CPU: the resident experts' mapped blobs stay within --cpu-mem; tokens unchanged; blobs
    packed in memory beyond the cap are a one-line error."""
    import dsv3lite
    from dsv3lite import expert_cache_dir

    path, kw, plain, blob = _int4_checkpoint(tmp_path, monkeypatch)
    expected = [c.token_id for c in plain.generate("bounded", max_tokens=10)]
    capped = dsv3lite.load(path, cpu_mem=5 * blob, **kw)
    capped.stop_ids = set()
    assert [c.token_id for c in capped.generate("bounded", max_tokens=10)] == expected
    caps = {m.resident_cap for m in capped.model.modules() if getattr(m, "resident_cap", None) is not None}
    assert len(caps) == 1
    cap = caps.pop()
    assert cap.dropped > 0 and cap.resident <= 5 * blob
    monkeypatch.setenv(expert_cache_dir.ENV, "off")
    with pytest.raises(UserError, match="--cpu-mem .* is below the .* of int4 expert blobs this run packs in memory"):
        dsv3lite.load(path, cpu_mem=5 * blob, **kw)
