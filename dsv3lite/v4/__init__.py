"""The DeepSeek-V4 family (V4-Flash, V4-Pro): config, network, cache objects and checkpoint names
(docs/dsv4-math.md has the math)."""
