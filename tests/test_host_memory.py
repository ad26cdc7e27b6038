"""The host tier asks for exactly the bytes of its expert blobs (no power-of-two rounding), and releases them."""
from __future__ import annotations

import gc

import pytest
import torch

from dsv3lite.errors import UserError
from dsv3lite.offload.host_memory import pinned_empty


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
