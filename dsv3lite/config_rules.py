"""The rules every config field the model reads must meet: type and range, one table, applied when ModelArgs is
built. A value outside them would run and print garbage (a negative layer count, eps -1, top-0 routing, a YaRN
factor of 0), so it is refused with one line naming the field, its value and what it must be.

FIELD_RULES holds the rules of the fields every family shares; a family adds or overrides its own in FAMILY_RULES
under its model_type (the same field names as ModelArgs). CROSS_RULES tie fields together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UserError


@dataclass(frozen=True)
class Rule:
    """kind: "int" | "float" | "bool" | "str" | "int_list" (one int or a list of them); lo/hi: bounds, lo
    excluded when lo_open; optional: None is allowed; choices: the allowed strings; even: an even int."""
    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    optional: bool = False
    choices: tuple[str, ...] | None = None
    even: bool = False

    def problem(self, value) -> str | None:
        """What is wrong with `value`, or None."""
        if value is None:
            return None if self.optional else "must be given"
        if self.kind == "int_list":
            values = value if isinstance(value, (list, tuple)) else [value]
            return next((p for v in values if (p := Rule("int", self.lo, self.hi).problem(v))), None)
        if self.kind == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind == "str":
            if not isinstance(value, str):
                return "must be a string"
            if self.choices is not None and value not in self.choices:
                return f"must be one of {', '.join(self.choices)}"
            return None
        number = (int,) if self.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number):
            return f"must be {'an integer' if self.kind == 'int' else 'a number'}"
        if not math.isfinite(value):
            return "must be finite"
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None and value > self.hi:
            return f"must be <= {self.hi:g}"
        if self.even and value % 2:
            return "must be even"
        return None


POSITIVE_INT = Rule("int", lo=1)
COUNT = Rule("int", lo=0)
POSITIVE = Rule("float", lo=0, lo_open=True)

FIELD_RULES: dict[str, Rule] = {
    "vocab_size": POSITIVE_INT,
    "hidden_size": POSITIVE_INT,
    "num_hidden_layers": POSITIVE_INT,
    "rms_norm_eps": POSITIVE,
    "tie_word_embeddings": Rule("bool"),
    "bos_token_id": Rule("int", lo=0, optional=True),
    "eos_token_id": Rule("int_list", lo=0, optional=True),
    "torch_dtype": Rule("str", optional=True),
    # dense MLP
    "intermediate_size": POSITIVE_INT,
    "first_k_dense_replace": COUNT,
    "moe_layer_freq": POSITIVE_INT,
    # mla
    "num_attention_heads": POSITIVE_INT,
    "q_lora_rank": Rule("int", lo=1, optional=True),
    "kv_lora_rank": POSITIVE_INT,
    "qk_nope_head_dim": POSITIVE_INT,
    "qk_rope_head_dim": Rule("int", lo=2, even=True),          # RoPE rotates pairs
    "v_head_dim": POSITIVE_INT,
    # dsa (V3.2)
    "index_topk": COUNT,
    "index_n_heads": POSITIVE_INT,
    "index_head_dim": POSITIVE_INT,
    # moe
    "moe_intermediate_size": POSITIVE_INT,
    "n_routed_experts": POSITIVE_INT,
    "n_shared_experts": COUNT,
    "num_experts_per_tok": POSITIVE_INT,
    "n_group": POSITIVE_INT,
    "topk_group": POSITIVE_INT,
    "routed_scaling_factor": POSITIVE,
    "norm_topk_prob": Rule("bool"),
    "scoring_func": Rule("str", choices=("sigmoid", "softmax")),
    "topk_method": Rule("str", choices=("noaux_tc", "greedy", "group_limited_greedy")),
    # rope / yarn
    "rope_theta": Rule("float", lo=1, lo_open=True),          # its log divides the YaRN correction
    "rope_type": Rule("str", choices=("default", "yarn")),
    "original_max_position_embeddings": POSITIVE_INT,
    "max_position_embeddings": POSITIVE_INT,
    "rope_factor": POSITIVE,
    "beta_fast": POSITIVE,
    "beta_slow": POSITIVE,
    "mscale": Rule("float", lo=0, optional=True),
    "mscale_all_dim": Rule("float", lo=0, optional=True),
    "rope_attention_factor": Rule("float", lo=0, lo_open=True, optional=True),
    "rope_interleave": Rule("bool"),
    # mtp
    "num_nextn_predict_layers": COUNT,
    # routed experts stored in an expert format of their own (quant/table.py; Kimi-K2-Thinking / K2.5: int4g32)
    "released_experts": Rule("str", optional=True),
}

# per model_type: rules added to (or replacing) FIELD_RULES for that family's own fields
FAMILY_RULES: dict[str, dict[str, Rule]] = {}

# (fields, test, what must hold): checked after each field passed its own rule
CROSS_RULES = (
    (("num_experts_per_tok", "n_routed_experts"), lambda a: a.num_experts_per_tok <= a.n_routed_experts,
     "num_experts_per_tok must not exceed n_routed_experts"),
    (("n_routed_experts", "n_group"), lambda a: a.n_routed_experts % a.n_group == 0,
     "n_routed_experts must be divisible by n_group"),
    (("topk_group", "n_group"), lambda a: a.topk_group <= a.n_group, "topk_group must not exceed n_group"),
    (("num_experts_per_tok", "n_routed_experts", "n_group", "topk_group"),
     lambda a: a.topk_method == "greedy" or a.num_experts_per_tok <= a.n_routed_experts // a.n_group * a.topk_group,
     "num_experts_per_tok must not exceed the experts of topk_group groups (n_routed_experts / n_group * topk_group)"),
    (("rope_factor",), lambda a: a.rope_type != "yarn" or a.rope_factor >= 1, "a YaRN rope factor must be >= 1"),
)


def rules_for(model_type: str) -> dict[str, Rule]:
    return {**FIELD_RULES, **FAMILY_RULES.get(model_type, {})}


def check(args) -> None:
    """Every ruled field of ModelArgs `args`, then the cross-field rules: UserError on the first broken one."""
    for name, rule in rules_for(args.model_type).items():
        value = getattr(args, name)
        problem = rule.problem(value)
        if problem:
            raise UserError(f"config: {name} {problem}, got {value!r}")
    for names, holds, what in CROSS_RULES:
        if not holds(args):
            values = ", ".join(f"{n}={getattr(args, n)!r}" for n in names)
            raise UserError(f"config: {what} ({values})")
