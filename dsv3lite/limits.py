"""Token-count limits that decide which path a forward takes, in one place, with the rules that tie them.

A forward of n tokens over the latent cache:
- n <= ABSORB_MAX_TOKENS: absorbed attention over the latent cache (the MLA decode kernel on GPU), so a
  decode step and an MTP verify of MAX_DRAFT_TOKENS drafts + 1 take this path;
- n <= FUSED_MAX_TOKENS: routed experts through the fused MoE kernel (resident blobs or the slot pool);
- n > BULK_TOKENS: an offloaded MoE call streams the layer's experts in bulk (prefill), and the router
  lookahead prefetch is skipped;
- prompts are prefilled PREFILL_CHUNK tokens at a time (this also sizes the planner's workspace), layer-major in
  groups of up to LAYER_MAJOR_TOKENS tokens (prefill.py: each MoE layer's routed experts called once per group).
"""
from __future__ import annotations

from .kernels.mla_decode import MAX_QUERIES as MLA_KERNEL_MAX_QUERIES

PREFILL_CHUNK = 512          # tokens per prefill forward
LAYER_MAJOR_TOKENS = 4096    # tokens per layer-major prefill group (its hidden states are held per layer)
ABSORB_MAX_TOKENS = 4        # forwards of up to this many tokens use the absorbed (latent) attention
MAX_DRAFT_TOKENS = 3         # MTP drafts per step (a verify forward is drafts + 1 tokens)
INDEX_SCORE_ELEMENTS = 1 << 24  # indexer scores [queries, index heads, keys] (fp32) computed at once in a prefill
FUSED_MAX_TOKENS = 16        # routed experts through the fused MoE kernel up to this many tokens
BULK_TOKENS = 8              # an offloaded MoE call of more tokens than this streams the layer's experts

# an absorbed forward goes through the MLA decode kernel, whose query count is bounded
assert ABSORB_MAX_TOKENS <= MLA_KERNEL_MAX_QUERIES
# a verify forward (drafts + the sampled token) must stay on the absorbed, fused, non-bulk decode path
assert MAX_DRAFT_TOKENS + 1 <= ABSORB_MAX_TOKENS <= BULK_TOKENS <= FUSED_MAX_TOKENS <= PREFILL_CHUNK
assert LAYER_MAJOR_TOKENS % PREFILL_CHUNK == 0      # a group is whole chunks
