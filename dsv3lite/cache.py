"""Cache objects: the state each layer keeps across the forward passes of one sequence, one class per layer kind,
and `ModelCache`, the Engine's cache over a model's blocks. `Positions` says where a forward's tokens sit.

A layer kind's cache is written and read by that kind's attention (its own methods); what every kind offers the
rest of the runtime is the same:

    truncate(length)              the state becomes what writing tokens [0, length) gave (speculative rollback:
                                  any length from the start of the latest write; 0 forgets everything)
    bytes_per_token(args)         bytes a token adds to the layer's state, for the planner (classmethods)
    fixed_bytes(args)             bytes the layer holds whatever the context

The V3 family keeps one kind, `LatentCache`: per token the normalised latent and the RoPE'd k_pe (V3.2: and the
indexer's key). The main layers' latents are views into one tensor [n_layers, 1, Tmax, cache_dim], so the compiled
CPU step can walk them with one stride.
"""
from __future__ import annotations

import abc

import torch

from .layers import as_dtype

CACHE_VALUE_BYTES = 2            # the planner counts cached values at bf16 (the GPU's dtype)


class Positions:
    """Where the S tokens of a forward sit: start .. start + S - 1. An eager forward knows `start` on the host; a
    captured decode step (dsv3lite/executors/graphs.py) holds the positions only on the device, `start` None:
    index int64 [S] and seqlens int32 [1] (start + S), so that nothing of one step is baked into its graph."""
    __slots__ = ("start", "length", "index", "seqlens")

    def __init__(self, start: int | None, length: int, index: torch.Tensor | None = None,
                 seqlens: torch.Tensor | None = None):
        assert start is not None or (index is not None and seqlens is not None), "device positions need both tensors"
        self.start, self.length, self.index, self.seqlens = start, length, index, seqlens

    @classmethod
    def on_device(cls, index: torch.Tensor, seqlens: torch.Tensor) -> "Positions":
        return cls(None, index.shape[0], index, seqlens)

    @property
    def end(self) -> int:
        """start + S (host positions only)."""
        return self.start + self.length

    def rope(self, rotary, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables' rows of these positions, [S, 1, dr] in `dtype`: a slice on the host's positions, an
        index_select on the device's (the same rows, so the same values)."""
        if self.start is not None:
            cos, sin = rotary(self.start, self.length, device)
        else:
            cos, sin = rotary.cos.index_select(0, self.index), rotary.sin.index_select(0, self.index)
        return as_dtype(cos, dtype)[:, None], as_dtype(sin, dtype)[:, None]


class LayerCache(abc.ABC):
    """One layer's state for one sequence (see the module docstring); each layer kind implements the abstract
    methods."""

    @abc.abstractmethod
    def truncate(self, length: int) -> None:
        """The state becomes what writing tokens [0, length) gave."""

    def keepable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, that truncate can keep (a kind that can only roll back its
        latest write answers 0 for an earlier length: the prompt is then prefilled again from the start)."""
        return length

    @abc.abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the state (memory accounting)."""

    @classmethod
    @abc.abstractmethod
    def bytes_per_token(cls, args) -> int:
        """Bytes a token adds to the layer's state, for the planner."""

    @classmethod
    def fixed_bytes(cls, args) -> int:
        return 0


class LatentCache(LayerCache):
    """A V3-family layer's cache: data [1, Tmax, cache_dim] = per position [normalised latent c | RoPE'd k_pe]
    (latent_dim values), then V3.2's indexer key. Rows past the valid length are never read, so truncating costs
    nothing: later writes overwrite them."""

    def __init__(self, data: torch.Tensor, latent_dim: int):
        assert data.dim() == 3, "a layer's latent cache is [B, Tmax, cache_dim]"
        self.data, self.latent_dim = data, latent_dim

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def write(self, pos: Positions, rows: torch.Tensor, index_keys: torch.Tensor | None = None) -> None:
        """Store the tokens' latents rows [B, S, latent_dim] (and V3.2's index keys [B, S, index_dim])."""
        if index_keys is not None:
            rows = torch.cat([rows, index_keys], dim=-1)
        width = rows.shape[-1]
        if pos.start is not None:
            self.data[:, pos.start:pos.end, :width] = rows
        else:
            self.data[0, :, :width].index_copy_(0, pos.index, rows[0].to(self.data.dtype))

    def latents(self, pos: Positions) -> torch.Tensor:
        """What attention reads: rows [B, start + S, cache_dim] (host positions), or the whole cache (device
        positions: the kernel reads pos.seqlens rows of it)."""
        return self.data if pos.start is None else self.data[:, :pos.end]

    def truncate(self, length: int) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    @classmethod
    def bytes_per_token(cls, args) -> int:
        return args.cache_dim * CACHE_VALUE_BYTES


class ModelCache:
    """The caches of a model's blocks (index = position in model.blocks(): the `n_main` main layers, then the MTP
    block), for one sequence of up to `capacity` tokens. `tensor`: the one tensor behind them, where the family
    keeps one (the V3 family's [n_blocks, 1, Tmax, cache_dim]), else None."""

    def __init__(self, layers: list[LayerCache], capacity: int, tensor: torch.Tensor | None = None,
                 n_main: int | None = None):
        self.layers, self.capacity, self.tensor = layers, capacity, tensor
        self.n_main = len(layers) if n_main is None else n_main

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def truncate(self, length: int, main: bool = False) -> None:
        """Every layer's state back to tokens [0, length) (main: the main layers only; the MTP block's cache has
        its own length, speculative.Speculator's)."""
        for layer in self.layers[:self.n_main] if main else self.layers:
            layer.truncate(length)

    def keepable(self, length: int, main: bool = False) -> int:
        """The longest prefix of at most `length` tokens every layer (main: every main layer) can keep."""
        for layer in self.layers[:self.n_main] if main else self.layers:
            length = min(length, layer.keepable(length))
        return length

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding every layer's state (memory accounting)."""
        if self.tensor is not None:
            return [self.tensor]
        return [t for layer in self.layers for t in layer.tensors()]


def latent_caches(tensor: torch.Tensor, latent_dim: int, n_main: int | None = None) -> ModelCache:
    """ModelCache over a V3-family latent tensor [n_blocks, B, Tmax, cache_dim] (views, no copy)."""
    return ModelCache([LatentCache(t, latent_dim) for t in tensor.unbind(0)], tensor.shape[2], tensor, n_main)


def as_model_cache(cache, latent_dim: int) -> ModelCache | None:
    """A ModelCache as it is; a V3-family latent tensor [n_blocks, B, Tmax, cache_dim] wrapped (tests and
    benchmarks build those by hand); None as it is."""
    if cache is None or isinstance(cache, ModelCache):
        return cache
    return latent_caches(cache, latent_dim)
