"""compressed-tensors checkpoints as Kimi-K2-Thinking and Kimi-K2.5 are released: what their quantization_config
declares, what dsv3lite serves of it (refused in one line otherwise, before any weight is read), and their tensor
names.

A `pack-quantized` checkpoint stores each quantized Linear `X` as
  X.weight_packed  int32 [N, K/8]    eight 4-bit codes a word, code i of a word in bits 4i..4i+3, each the signed
                                     value plus 8 (so byte b of a row holds k = 2b in its low nibble, 2b + 1 high)
  X.weight_scale   bf16  [N, K/32]   one scale per group of 32 along K (the input dimension): w = q * s
  X.weight_shape   int64 [2]         (N, K)
and every other Linear (the `ignore` list names them) as a plain `X.weight`. dsv3lite serves routed experts of this
scheme as released (quant/int4g32.py: symmetric int4, group 32, bf16 scales); the rest stays BF16. Torch-free: the
config reads this module.
"""
from __future__ import annotations

import re

from ..errors import UserError

QUANT_METHOD = "compressed-tensors"
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"   # X.weight -> X.<these>
SERVED_FORMAT = "int4g32"                 # the expert format (quant/table.py) of the one scheme served
GROUP = 32
# the scheme served: anything else in a config group's `weights` is refused, naming the field
_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
# Linear modules of a V3-family text model (checkpoint names without the ".weight"): every one must be left BF16
# by `ignore`, every routed-expert one quantized (the router, mlp.gate, is never a quantized Linear)
_DENSE_LINEARS = tuple(f"model.layers.1.self_attn.{p}" for p in
                       ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")) + \
    tuple(f"model.layers.{m}.{p}_proj" for m in ("0.mlp", "1.mlp.shared_experts") for p in ("gate", "up", "down")) + \
    ("lm_head",)
_MTP_LINEARS = ("model.layers.1.eh_proj",)
_EXPERT_LINEARS = tuple(f"model.layers.1.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down"))


def packed_names(weight_name: str) -> tuple[str, str, str]:
    """(weight_packed, weight_scale, weight_shape) names of checkpoint weight `X.weight`."""
    stem = weight_name.removesuffix("weight")
    return stem + PACKED, stem + SCALE, stem + SHAPE


def _refuse(what: str) -> UserError:
    return UserError(f"{QUANT_METHOD} checkpoint: {what}; dsv3lite serves pack-quantized symmetric int4 routed "
                     f"experts with group {GROUP} (Kimi-K2-Thinking / K2.5 as released) and the rest in BF16")


def _matches(name: str, patterns) -> bool:
    # compressed-tensors' rule: "re:PATTERN" is re.match on the module name, "Linear" every Linear, else the name
    return any(p == "Linear" or (p[3:] and re.match(p[3:], name) if p.startswith("re:") else p == name)
               for p in patterns)


def expert_format(quant: dict, text_prefix: str = "", mtp: bool = False) -> str:
    """The expert format of a compressed-tensors `quantization_config` ("int4g32"), or UserError (one line) for
    what dsv3lite does not serve: another format or bit width, asymmetric or non-group weights, another group
    size, activation or KV-cache quantization, activation-ordered groups, a checkpoint not in its compressed form,
    or a Linear other than the routed experts quantized (its `ignore` list decides). text_prefix: the language
    model's name prefix in a multimodal checkpoint (Kimi-K2.5: "language_model."); mtp: the model declares an MTP
    layer (whose eh_proj must stay BF16 too)."""
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (the weights are not stored packed)")
    if quant.get("kv_cache_scheme"):
        raise _refuse("a quantized KV cache (kv_cache_scheme)")
    if quant.get("transform_config"):
        raise _refuse("weight transforms (transform_config)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("no config_groups")
    targets = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise _refuse(f"config group {name!r} is not an object")
        fmt = group.get("format") or quant.get("format")
        if fmt != "pack-quantized":
            raise _refuse(f"format {fmt!r}")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise _refuse(f"activation quantization ({name}.{key})")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise _refuse(f"config group {name!r} has no weights scheme")
        for key, want in _WEIGHTS.items():
            got = weights.get(key, True if key == "symmetric" else None)
            if got != want:
                raise _refuse(f"weights {key} {got!r} in {name} (served: {want!r})")
        if weights.get("dynamic"):
            raise _refuse(f"dynamic weight scales in {name}")
        if weights.get("actorder") == "group" or weights.get("block_structure"):
            raise _refuse(f"activation-ordered or block-structured groups in {name}")
        targets += list(group.get("targets") or [])
    ignore = list(quant.get("ignore") or [])

    def quantized(bare: str) -> bool:
        names = {bare, text_prefix + bare}
        return any(_matches(n, targets) for n in names) and not any(_matches(n, ignore) for n in names)

    try:
        experts = [quantized(n) for n in _EXPERT_LINEARS]
    except re.error as e:
        raise _refuse(f"a target or ignore pattern is not a regular expression ({e})") from None
    if not all(experts):
        raise _refuse("quantizes none of the routed experts" if not any(experts) else
                      "quantizes only some of a routed expert's matrices")
    dense = next((n for n in _DENSE_LINEARS + (_MTP_LINEARS if mtp else ()) if quantized(n)), None)
    if dense is not None:
        raise _refuse(f"{text_prefix}{dense} is quantized too (its ignore list does not name it)")
    return SERVED_FORMAT


def _check_parts(name: str, shape, packed: tuple, scale: tuple, stored_shape) -> None:
    """One line on a packed weight whose tensors do not hold an int4 group-32 matrix of `shape` (N, K):
    packed/scale: (dtype name, shape) of weight_packed / weight_scale; stored_shape: weight_shape's values or None."""
    n, k = shape
    if k % GROUP:
        raise UserError(f"{name}: {k} input features are not a multiple of the int4 group size {GROUP}")
    if stored_shape is not None and list(stored_shape) != [n, k]:
        raise UserError(f"{name}'s {SHAPE} is {list(stored_shape)}, expected {[n, k]} from config.json")
    if packed != ("I32", (n, k // 8)):
        raise UserError(f"{name}'s {PACKED} is {packed[0]} {list(packed[1])}, expected I32 {[n, k // 8]} (4-bit codes "
                        f"of a {n}x{k} weight)")
    if scale != ("BF16", (n, k // GROUP)):
        raise UserError(f"{name}'s {SCALE} is {scale[0]} {list(scale[1])}, expected BF16 {[n, k // GROUP]} (one "
                        f"bf16 scale per {GROUP} weights)")


def packed_entry_bytes(meta: dict, name: str, shape) -> int | None:
    """Bytes of weight `name` stored packed, its header entries (`meta`: name -> {dtype, shape}) checked against
    `shape`; None when it is not stored packed."""
    packed, scale, stored = packed_names(name)
    if packed not in meta:
        return None
    p, s = meta[packed], meta.get(scale)
    if s is None:
        raise UserError(f"packed weight {packed} has no {scale}")
    _check_parts(name, shape, (p["dtype"], tuple(p["shape"])), (s["dtype"], tuple(s["shape"])), None)
    return (shape[0] * shape[1]) // 2 + 2 * (shape[0] * shape[1]) // GROUP


def read_packed(reader, name: str, shape, scratch=None):
    """(weight_packed int32 [N, K/8], weight_scale bf16 [N, K/32]) of weight `name` when the checkpoint stores it
    packed, checked against `shape` (N, K) and its weight_shape; None when it does not. reader: an
    hf_checkpoint.TensorReader; scratch: as its `get` takes it (a key of this thread's reused buffers)."""
    packed, scale, stored = packed_names(name)
    if reader.has(name) or not reader.has(packed):
        return None
    w = reader.get(packed, scratch)
    s = reader.get(scale, None if scratch is None else (scratch, SCALE))
    stored_shape = reader.get(stored).tolist() if reader.has(stored) else None
    dtypes = {"torch.int32": "I32", "torch.bfloat16": "BF16"}
    _check_parts(name, shape, (dtypes.get(str(w.dtype), str(w.dtype)), tuple(w.shape)),
                 (dtypes.get(str(s.dtype), str(s.dtype)), tuple(s.shape)), stored_shape)
    return w, s
