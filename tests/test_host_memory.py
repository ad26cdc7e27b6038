"""The host tier asks for exactly the bytes of its expert blobs (no power-of-two rounding), and releases them."""
from __future__ import annotations

import gc

import pytest

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
