"""DeepSeek-V4's attention kinds (docs/dsv4-math.md §1.2), named once: the config parses them, the cache objects
and attention modules are chosen by them."""

SLIDING, CSA, HCA = "sliding", "csa", "hca"     # sliding window only; + CSA's compressor and indexer; + HCA's
ATTN_KINDS = (SLIDING, CSA, HCA)
