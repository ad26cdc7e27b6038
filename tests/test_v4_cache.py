"""DeepSeek-V4 cache objects (dsv3lite/v4/cache.py) and the MTP block (no oracle for the block's wiring in
transformers: tested by invariants, with transformers' decoder layer and hc_head as the oracle of its parts):
rollback after a verify pass equals plain decoding for every cache kind, truncate's contract, and the MTP block
with a cache equals it without."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dsv3lite.limits import MAX_DRAFT_TOKENS
from dsv3lite.testing_v4 import load_v4, v4_config, write_v4_pair
from dsv3lite.v4.cache import new_cache
from dsv3lite.v4.checkpoint import checkpoint_name
from dsv3lite.v4.config import CSA, HCA, SLIDING

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = dict(log=lambda m: None)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4cache")
    official, _ = write_v4_pair(root / "official", root / "hf", "tiny")
    m = load_v4(official, **QUIET)
    assert m.mtp is not None
    return m


def sequence(model, n=64, seed=0):
    return torch.randint(2, model.args.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def plain_run(model, seq, prompt):
    """Main logits and MTP logits per position, prefilling `prompt` tokens then one token at a time."""
    cache = new_cache(model.args, seq.shape[1], with_mtp=True)
    with torch.inference_mode():
        states = [model.hidden(seq[:, :prompt], 0, cache)]
        states += [model.hidden(seq[:, p:p + 1], p, cache) for p in range(prompt, seq.shape[1])]
        state = torch.cat(states, 1)
        own = cache[model.args.num_hidden_layers]
        mtp = torch.cat([model.mtp_hidden(state[:, p:p + 1], seq[:, p + 1:p + 2], p, own)
                         for p in range(seq.shape[1] - 1)], 1)
        return model.logits(state), model.mtp_logits(mtp)


def test_rollback_after_verify_equals_plain_decoding(model):
    """Verify passes of 1 + k tokens (k <= MAX_DRAFT_TOKENS) whose drafts are partly wrong, each followed by a
    rollback to the accepted length, across window, CSA and HCA boundaries, for every cache kind (the MTP block's
    ring included): the logits of every accepted position, and everything after, equal plain decoding's."""
    a = model.args
    assert {a.attn_kind(i) for i in range(a.num_hidden_layers + 1)} == {SLIDING, CSA, HCA}
    seq, prompt = sequence(model), 5
    ref, ref_mtp = plain_run(model, seq, prompt)
    cache = new_cache(a, seq.shape[1] + MAX_DRAFT_TOKENS + 1, with_mtp=True)
    gen = torch.Generator().manual_seed(1)
    got = torch.zeros_like(ref)
    got_mtp = torch.zeros_like(ref_mtp)
    with torch.inference_mode():
        state = model.hidden(seq[:, :prompt], 0, cache)
        got[:, :prompt] = model.logits(state)
        mtp_pos = 0
        pos = prompt
        while pos < seq.shape[1]:
            k = int(torch.randint(0, MAX_DRAFT_TOKENS + 1, (1,), generator=gen))
            accept = int(torch.randint(0, k + 1, (1,), generator=gen))
            chunk = seq[:, pos:pos + 1 + k].clone()
            if accept < chunk.shape[1] - 1:                 # a wrong draft after the accepted ones
                chunk[0, 1 + accept] = (chunk[0, 1 + accept] + 7) % a.vocab_size
            verify = model.hidden(chunk, pos, cache)
            keep = min(1 + accept, chunk.shape[1])
            got[:, pos:pos + keep] = model.logits(verify[:, :keep])
            state = torch.cat([state, verify[:, :keep]], 1)
            cache.truncate(pos + keep, main=True)
            pos += keep
            # the MTP block catches up over the accepted pairs, in a verify-sized pass, then rolls back one
            end = min(pos, seq.shape[1] - 1)
            if end > mtp_pos:
                mtp = model.mtp_hidden(state[:, mtp_pos:end], seq[:, mtp_pos + 1:end + 1], mtp_pos,
                                       cache[a.num_hidden_layers])
                got_mtp[:, mtp_pos:end] = model.mtp_logits(mtp)
                if end - mtp_pos > 1:                        # keep the last pair to redo: a rollback of the ring
                    cache[a.num_hidden_layers].truncate(end - 1)
                    end -= 1
                mtp_pos = end
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_mtp[:, :mtp_pos], ref_mtp[:, :mtp_pos], rtol=0, atol=2e-5)


def test_truncate_contract(model):
    """truncate reaches 0 or any length down to MAX_DRAFT_TOKENS + 1 before the furthest write, across several writes
    (a verify pass, or drafts written one at a time); keepable says how far a prefix can be kept (0: start again)."""
    a = model.args
    cache = new_cache(a, 64, with_mtp=False)
    seq = sequence(model, 40, seed=2)
    with torch.inference_mode():
        model.hidden(seq[:, :30], 0, cache)
        with pytest.raises(ValueError):      # inside a long (prefill) write: its ring slots are overwritten
            cache.truncate(10)
        assert cache.keepable(10) == 0 and cache.keepable(28) == 28 and cache.keepable(99) == 30
        model.hidden(seq[:, 30:34], 30, cache)
        cache.truncate(31)                                   # back to a length inside the last (verify) write
        with pytest.raises(ValueError):
            cache.truncate(29)                               # more than MAX_DRAFT_TOKENS + 1 before position 34
        assert cache.keepable(29) == 0 and cache.keepable(33) == 31
        with pytest.raises(ValueError):
            model.hidden(seq[:, 33:34], 33, cache)           # past the length
        model.hidden(seq[:, 31:40], 31, cache)               # a write at a shorter length rolls back first
        cache.truncate(0)
        again = model.logits(model.hidden(seq, 0, cache))
        assert torch.equal(again, model.logits(model.hidden(seq, 0, new_cache(a, 64, with_mtp=False))))
        # one token at a time (drafts), each closing or opening windows, then back over all of them
        base = 36 - MAX_DRAFT_TOKENS
        plain = new_cache(a, 64, with_mtp=False)
        model.hidden(seq[:, :base], 0, plain)
        ref = [model.logits(model.hidden(seq[:, p:p + 1], p, plain)) for p in range(base, 40)]
        cache.truncate(0)
        model.hidden(seq[:, :base], 0, cache)
        for p in range(base, base + MAX_DRAFT_TOKENS + 1):
            model.hidden(seq[:, p:p + 1] + 1, p, cache)      # wrong tokens
        cache.truncate(base)
        got = [model.logits(model.hidden(seq[:, p:p + 1], p, cache)) for p in range(base, 40)]
        assert all(torch.equal(x, y) for x, y in zip(got, ref))
    assert all(c.length == 40 for c in cache.layers)


def test_mtp_block_against_transformers_parts(model, tmp_path):
    """The MTP block's tensor flow (§6) written out here from the loaded tensors, its V4 block and hc_head run by
    transformers' DeepseekV4DecoderLayer and HyperHead with the same weights, the shared head: equal to
    mtp_hidden / mtp_logits; and the block with a cache, chunk by chunk, equals it without."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    from transformers.masking_utils import create_sliding_window_causal_mask

    a, mtp = model.args, model.mtp
    seq = sequence(model, 40, seed=3)
    with torch.inference_mode():
        x = model.hidden(seq[:, :-1])                                    # main streams [1, S, 4, D]
        got_state = model.mtp_hidden(x, seq[:, 1:], 0)
        got = model.mtp_logits(got_state)

        def rms(v, w):
            v = v.float()
            return w * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + a.rms_norm_eps)
        e = F.linear(rms(model.embed(seq[:, 1:]), mtp.enorm.weight), mtp.e_proj.weight)
        y = F.linear(rms(x, mtp.hnorm.weight), mtp.h_proj.weight) + e[:, :, None]
        # transformers' block with the MTP block's weights: a one-layer model loaded from its tensors
        spec = {k: v for k, v in v4_config("tiny", num_hidden_layers=1, compress_ratios=[0, 0],
                                           num_hash_layers=0).items() if k != "model_type"}
        hf = DeepseekV4ForCausalLM(DeepseekV4Config(**spec)).eval()
        tensors = {}
        for name, t in model.state_dict().items():
            if not name.startswith("mtp.block."):
                continue
            rest = checkpoint_name(name, a)[len("mtp.0."):]            # official name inside the block
            rest = {"attn.kv_norm.weight": "attn.norm.weight"}.get(rest, rest)   # transformers' layout
            if ".ffn.experts." in name:
                tensors.update({f"model.layers.0.{rest.replace('<e>', str(i))}": t[i] for i in range(t.shape[0])})
            else:
                tensors[f"model.layers.0.{rest}"] = t
        tensors.update({"model.hc_head.hc_fn": mtp.hc_head.fn, "model.hc_head.hc_base": mtp.hc_head.base,
                        "model.hc_head.hc_scale": mtp.hc_head.scale, "model.norm.weight": mtp.norm.weight,
                        "model.embed_tokens.weight": model.embed.weight, "head.weight": model.head.weight})
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
        hf.config.save_pretrained(tmp_path)
        hf = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        pos = torch.arange(y.shape[1])[None]
        emb = y[:, :, 0]
        rope = {k: hf.model.rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=emb, attention_mask=None,
                                                 cache=None, position_ids=pos)
        out = hf.model.layers[0](y, position_embeddings=rope, position_ids=pos, attention_mask=mask,
                                 input_ids=seq[:, 1:])
        torch.testing.assert_close(got_state, out, rtol=0, atol=1e-5)
        torch.testing.assert_close(got, hf.lm_head(hf.model.norm(hf.model.hc_head(out))), rtol=0, atol=1e-4)
        # with a cache, in chunks (the state fed back is the MTP streams' shape)
        cache = new_cache(a, 40, with_mtp=True)
        cuts = [0, 1, 9, 10, 23, 39]
        chunks = [model.mtp_hidden(x[:, i:j], seq[:, i + 1:j + 1], i, cache[a.num_hidden_layers])
                  for i, j in zip(cuts, cuts[1:])]
        torch.testing.assert_close(torch.cat(chunks, 1), got_state, rtol=0, atol=1e-5)
        assert got_state.shape == x.shape
