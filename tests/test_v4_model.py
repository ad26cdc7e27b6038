"""The DeepSeek-V4 network (dsv3lite/v4) against transformers 5.24's DeepseekV4 in fp32 (the oracle): logits on
tiny configs with all three attention kinds, hash and learned routers, odd sizes and >= 8 index heads; greedy
decoding through the cache objects against generate(); chunked prefill; the official layout (FP8 ue8m0, MXFP4)
loading to the same network as transformers' layout; the spine's surface (observers, router_input)."""
from __future__ import annotations

import pytest
import torch

from dsv3lite.testing_v4 import load_v4, write_v4_hf, write_v4_pair
from dsv3lite.v4.cache import new_cache
from dsv3lite.v4.config import CSA, HCA, SLIDING

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = dict(log=lambda m: None)
SEQ = 70                                  # window 8, CSA 4 (selection past 4 entries), HCA 16: every path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4pair")
    return write_v4_pair(root / "official", root / "hf", "tiny")


@pytest.fixture(scope="module")
def odd_dir(tmp_path_factory):
    return write_v4_hf(tmp_path_factory.mktemp("v4odd"), "odd")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return write_v4_hf(tmp_path_factory.mktemp("v4bf16"), "tiny", seed=3, dtype=torch.bfloat16)


def oracle(path):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def dirs(pair, odd_dir, variant, bf16_dir=None):
    return {"tiny": pair[1], "odd": odd_dir, "bf16": bf16_dir}[variant]


def tokens(vocab, shape, seed=0):
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["tiny", "odd", "bf16"])
def test_logits_match_transformers(pair, odd_dir, bf16_dir, variant):
    """fp32 compute; "bf16": a save_pretrained checkpoint in bfloat16, computed in fp32 by both."""
    path = dirs(pair, odd_dir, variant, bf16_dir)
    hf, mine = oracle(path), load_v4(path, **QUIET)
    a = mine.args
    assert set(a.attn_kinds[:a.num_hidden_layers]) == {SLIDING, CSA, HCA} and 0 < a.num_hash_layers < 4
    assert a.index_n_heads >= 8 and SEQ // a.compress_rate_csa > a.index_topk       # the indexer selects
    ids = tokens(a.vocab_size, (2, SEQ))
    with torch.inference_mode():
        ref, got = hf(ids).logits, mine(ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # the SwiGLU clamp is active on these inputs: without it the logits move
    with torch.inference_mode():
        for moe in mine.moe_modules():
            moe.experts.limit = moe.shared_experts.limit = None
        assert (mine(ids) - ref).abs().max() > 1e-3


def greedy(model, prompt, n, capacity=160):
    cache = new_cache(model.args, capacity, with_mtp=False)
    with torch.inference_mode():
        state = model.hidden(prompt, 0, cache)
        out, pos = [], prompt.shape[1]
        for _ in range(n):
            tok = int(model.logits(state[:, -1:]).argmax(-1))
            out.append(tok)
            state = model.hidden(torch.tensor([[tok]]), pos, cache)
            pos += 1
    return out


@pytest.mark.parametrize("variant", ["tiny", "odd"])
def test_greedy_decoding_matches_generate(pair, odd_dir, variant):
    """45 tokens after a 9-token prompt: far past the window, across many CSA and several HCA boundaries."""
    path = dirs(pair, odd_dir, variant)
    hf, mine = oracle(path), load_v4(path, **QUIET)
    prompt = tokens(mine.args.vocab_size, (1, 9), seed=1)
    n = 45
    with torch.inference_mode():
        ref = hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, 9:].tolist()
    assert greedy(mine, prompt, n) == ref


def test_chunked_prefill_equals_one_pass(pair):
    mine = load_v4(pair[1], **QUIET)
    ids = tokens(mine.args.vocab_size, (2, SEQ), seed=2)
    cache = new_cache(mine.args, SEQ, with_mtp=False, batch=2)
    with torch.inference_mode():
        full = mine(ids)
        cuts = [0, 3, 4, 17, 33, 34, 51, SEQ]            # chunks closing and straddling windows, single tokens
        parts = [mine.logits(mine.hidden(ids[:, a:b], a, cache)) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_official_layout_loads_to_the_same_network(pair):
    """Released names and dtypes (FP8 e4m3 + ue8m0 .scale, MXFP4 experts as I8 + F8_E8M0, I32 tid2eid, BF16, F32)
    decode to exactly the values of the fp32 transformers-layout copy."""
    official, hf_layout = load_v4(pair[0], mtp=False, **QUIET), load_v4(pair[1], **QUIET)
    from safetensors import safe_open
    with safe_open(pair[0] / "model.safetensors", "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert dtypes["layers.2.ffn.experts.0.w1.weight"] == "I8" and dtypes["layers.2.ffn.experts.0.w1.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.0.ffn.gate.tid2eid"] == "I32" and dtypes["embed.weight"] == "BF16"
    a, b = official.state_dict(), hf_layout.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = tokens(official.args.vocab_size, (1, SEQ), seed=3)
    with torch.inference_mode():
        assert torch.equal(official(ids), hf_layout(ids))


def test_observers_and_router_input(pair):
    """Routing observers see tid2eid[token] on hash layers; router_input of a block's streams is exactly what its
    router reads."""
    mine = load_v4(pair[1], **QUIET)
    ids = tokens(mine.args.vocab_size, (1, 12), seed=4)
    seen, streams = {}, {}
    handle = mine.add_observer(on_attention=lambda block, x: streams.__setitem__(block.layer_id, x.clone()),
                               on_routing=lambda layer, e, s: seen.__setitem__(layer, (e.clone(), s.clone())))
    with torch.inference_mode():
        mine(ids)
        handle.remove()
        for block in mine.blocks():
            e, s = seen[block.layer_id]
            weights, e2, s2 = block.ffn.route(block.router_input(streams[block.layer_id]).flatten(0, 1),
                                              ids.flatten())
            assert torch.equal(e2, e) and torch.equal(s2, s)
            if mine.args.is_hash_layer(block.layer_id):
                assert torch.equal(e, block.ffn.gate.tid2eid[ids.flatten()])
    assert len(seen) == mine.args.num_hidden_layers == len(mine.moe_modules())


def test_query_blocks_give_the_same_logits(pair, monkeypatch):
    """Long prompts are scored a block of queries at a time (attention and indexer): blocks of a few queries give
    the logits of one block."""
    from dsv3lite.v4 import attention

    mine = load_v4(pair[1], **QUIET)
    ids = tokens(mine.args.vocab_size, (2, SEQ), seed=5)
    with torch.inference_mode():
        whole = mine(ids)
        monkeypatch.setattr(attention, "SCORE_ELEMENTS", 3000)      # 1-5 queries a block here
        torch.testing.assert_close(mine(ids), whole, rtol=0, atol=1e-5)
