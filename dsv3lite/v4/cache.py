"""DeepSeek-V4's cache objects, one per block and attention kind (docs/dsv4-math.md §4).

- every block: a window ring of the last sliding_window + MAX_DRAFT_TOKENS kv rows (after norm and RoPE), slot
  p mod slots, so a verify pass's rejected rows never overwrite a row the next step reads;
- HCA: the compressed entries [capacity // m, head_dim] and the compressor state;
- CSA: the same for its overlapping compressor, plus the lightning indexer's keys and its compressor state.

A compressor's state is the fp32 (Cv, G = Cz + ape) of the most recent tokens, in a ring of its own sized so that
every token the state after any accepted length needs is still there: the partial window, the previous window
(CSA) and MAX_DRAFT_TOKENS more. The whole cache is therefore a function of `length`: `truncate(length)` (a
speculative rollback, or 0) sets the length, and writes made after it are simply overwritten. Each kind is a
dsv3lite/cache.py LayerCache; `keepable` answers 0 for a length its rings no longer describe (the Engine then
prefills again from the start). The attention
modules (attention.py) call the kind-specific reads and writes; the pooling math lives there. `args` below is a
V4Args (config.py, which reads the planner's sizes from here).
"""
from __future__ import annotations

import math

import torch

from ..cache import LayerCache, ModelCache
from ..limits import MAX_DRAFT_TOKENS
from .kinds import CSA, HCA, SLIDING

KV_BYTES = 2                 # planner bytes per cached kv / entry / key value (bf16)
STATE_BYTES = 4              # compressor state values are fp32


class WindowRing:
    """The kv rows of the last `slots` positions, [B, slots, width]; position p at slot p mod slots."""

    def __init__(self, batch: int, slots: int, width: int, device, dtype):
        self.slots = slots
        self.kv = torch.zeros(batch, slots, width, device=device, dtype=dtype)

    def read(self, first: int, end: int) -> torch.Tensor:
        """Rows of positions first..end-1 ([B, end - first, width]); they must be among the last `slots` written."""
        if end <= first:
            return self.kv[:, :0]
        idx = torch.arange(first, end, device=self.kv.device) % self.slots
        return self.kv.index_select(1, idx)

    def write_at(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """rows [B, S, width] at device positions [S] (S <= slots; a captured step)."""
        self.kv.index_copy_(1, positions % self.slots, rows.to(self.kv.dtype))

    def write(self, rows: torch.Tensor, start: int) -> None:
        """rows [B, S, width] at positions start..; only the last `slots` of them are kept."""
        keep = min(rows.shape[1], self.slots)
        first = start + rows.shape[1] - keep
        idx = torch.arange(first, first + keep, device=self.kv.device) % self.slots
        self.kv.index_copy_(1, idx, rows[:, rows.shape[1] - keep:].to(self.kv.dtype))


class CompressorState:
    """One compressor's cache: its emitted entries [B, capacity // ratio, out_width] (the first length // ratio are
    valid) and the fp32 (Cv, G) of the recent tokens (a WindowRing each), from which the next entries pool."""

    def __init__(self, ratio: int, overlap: bool, in_width: int, out_width: int, batch: int, capacity: int,
                 device, dtype):
        self.ratio, self.overlap = ratio, overlap
        slots = self.history_slots(ratio, overlap)
        self.cv = WindowRing(batch, slots, in_width, device, torch.float32)
        self.g = WindowRing(batch, slots, in_width, device, torch.float32)
        self.entries = torch.zeros(batch, capacity // ratio, out_width, device=device, dtype=dtype)

    @staticmethod
    def history_slots(ratio: int, overlap: bool) -> int:
        """Tokens of (Cv, G) kept: a window (two with overlap) plus a verify pass's rejected drafts."""
        return ratio * (2 if overlap else 1) + MAX_DRAFT_TOKENS

    def pending(self, start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(Cv, G) of the tokens before `start` that windows completed from `start` on still read: from the start
        of start's window (of the window before it, with overlap), clipped at position 0; and that first position
        (negative when the overlap reaches before position 0, whose slots the caller treats as empty)."""
        first = (start // self.ratio - int(self.overlap)) * self.ratio
        lo = max(first, 0)
        return self.cv.read(lo, start), self.g.read(lo, start), first

    def remember(self, cv: torch.Tensor, g: torch.Tensor, start: int) -> None:
        self.cv.write(cv, start)
        self.g.write(g, start)

    def remember_at(self, cv: torch.Tensor, g: torch.Tensor, positions: torch.Tensor) -> None:
        self.cv.write_at(cv, positions)
        self.g.write_at(g, positions)

    def put(self, entries: torch.Tensor, first_window: int) -> None:
        self.entries[:, first_window:first_window + entries.shape[1]] = entries.to(self.entries.dtype)

    def view(self, count: int) -> torch.Tensor:
        """The first `count` entries [B, count, out_width]."""
        return self.entries[:, :count]

    def fixed_bytes(self) -> int:
        return 2 * self.cv.kv[0].numel() * STATE_BYTES


class SlidingCache(LayerCache):
    """A sliding-window block's cache (the MTP block's too): the window ring alone."""
    kind = SLIDING

    def __init__(self, args, layer_id: int, capacity: int, batch: int = 1, device=None,
                 dtype: torch.dtype = torch.float32):
        self.args, self.layer_id, self.capacity = args, layer_id, capacity
        self.window = WindowRing(batch, self.window_slots(args), args.head_dim, device, dtype)
        self.compressors: dict[str, CompressorState] = {}
        self.length = 0              # tokens written: positions 0..length-1
        self.high = 0                # the furthest end of a write since the last truncate(0): its ring slots (and
                                     # the compressors') hold positions from high - slots on

    @staticmethod
    def window_slots(args) -> int:
        return args.sliding_window + MAX_DRAFT_TOKENS

    def begin_write(self, start: int, n: int) -> None:
        """Before writing n tokens at `start`: a start below the length rolls back to it first (as truncate)."""
        if start != self.length:
            self.truncate(start)
        if start + n > self.capacity:
            raise ValueError(f"cache of {self.capacity} tokens cannot hold positions up to {start + n}")
        self.length = start + n
        self.high = max(self.high, self.length)

    def rollback_floor(self) -> int:
        """The lowest length (other than 0) truncate can return to: every ring keeps MAX_DRAFT_TOKENS slots beyond
        what the state at a length needs, so the state at any length down to high - MAX_DRAFT_TOKENS - 1 is still
        there (the start of a verify pass of up to MAX_DRAFT_TOKENS drafts, whatever was written since)."""
        return max(self.high - MAX_DRAFT_TOKENS - 1, 0)

    def keepable(self, length: int) -> int:
        length = min(length, self.length)
        return length if length >= self.rollback_floor() else 0

    def truncate(self, length: int) -> None:
        """The state becomes exactly what writing tokens [0, length) gave: length 0, or one from rollback_floor()
        up to the current length."""
        if length != 0 and not self.rollback_floor() <= length <= self.length:
            raise ValueError(f"cannot roll the cache back to {length}: only to 0 or to "
                             f"{self.rollback_floor()}..{self.length}")
        self.length = length
        if length == 0:
            self.high = 0

    def tensors(self) -> list[torch.Tensor]:
        out = [self.window.kv]
        for state in self.compressors.values():
            out += [state.cv.kv, state.g.kv, state.entries]
        return out

    @classmethod
    def bytes_per_token(cls, args, value_bytes: int = KV_BYTES) -> int:
        return 0

    @classmethod
    def fixed_bytes(cls, args, value_bytes: int = KV_BYTES) -> int:
        """The ring (in values of `value_bytes`) and the compressors' fp32 state."""
        return cls.window_slots(args) * args.head_dim * value_bytes


class HCACache(SlidingCache):
    """An HCA block's cache: the window ring plus its compressor's entries and state."""
    kind = HCA

    def __init__(self, args, layer_id: int, capacity: int, batch: int = 1, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(args, layer_id, capacity, batch, device, dtype)
        self.compressors["compressor"] = CompressorState(args.compress_rate_hca, False, args.head_dim,
                                                         args.head_dim, batch, capacity, device, dtype)

    @classmethod
    def bytes_per_token(cls, args, value_bytes: int = KV_BYTES) -> int:
        return math.ceil(args.head_dim * value_bytes / args.compress_rate_hca)

    @classmethod
    def fixed_bytes(cls, args, value_bytes: int = KV_BYTES) -> int:
        state = CompressorState.history_slots(args.compress_rate_hca, False) * args.head_dim * 2 * STATE_BYTES
        return super().fixed_bytes(args, value_bytes) + state


class CSACache(SlidingCache):
    """A CSA block's cache: the window ring, its overlapping compressor's entries and state, and the lightning
    indexer's keys and their compressor's state."""
    kind = CSA

    def __init__(self, args, layer_id: int, capacity: int, batch: int = 1, device=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__(args, layer_id, capacity, batch, device, dtype)
        m = args.compress_rate_csa
        self.compressors["compressor"] = CompressorState(m, True, 2 * args.head_dim, args.head_dim, batch, capacity,
                                                         device, dtype)
        self.compressors["indexer"] = CompressorState(m, True, 2 * args.index_head_dim, args.index_head_dim, batch,
                                                      capacity, device, dtype)

    @classmethod
    def bytes_per_token(cls, args, value_bytes: int = KV_BYTES) -> int:
        return math.ceil((args.head_dim + args.index_head_dim) * value_bytes / args.compress_rate_csa)

    @classmethod
    def fixed_bytes(cls, args, value_bytes: int = KV_BYTES) -> int:
        slots = CompressorState.history_slots(args.compress_rate_csa, True)
        state = slots * 2 * (args.head_dim + args.index_head_dim) * 2 * STATE_BYTES
        return super().fixed_bytes(args, value_bytes) + state


_CLASSES = {SLIDING: SlidingCache, CSA: CSACache, HCA: HCACache}


def cache_class(kind: str) -> type[SlidingCache]:
    """The cache object class of an attention kind."""
    return _CLASSES[kind]


def new_cache(args, capacity: int, with_mtp: bool, batch: int = 1, device=None,
              dtype: torch.dtype = torch.float32) -> ModelCache:
    """A ModelCache (dsv3lite/cache.py) over the main blocks (and the MTP block) of a network of `args`: each
    block's kind, the ring in `dtype`, the compressors' state in fp32."""
    blocks = range(args.num_hidden_layers + int(with_mtp))
    return ModelCache([cache_class(args.attn_kind(i))(args, i, capacity, batch, device, dtype) for i in blocks],
                      capacity, n_main=args.num_hidden_layers)
