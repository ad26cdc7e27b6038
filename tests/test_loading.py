"""Sizing a model before its weights are downloaded, and loading a checkpoint that has no tokenizer."""
from __future__ import annotations

import shutil

import pytest
import torch

import dsv3lite
from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.offload.setup import plan_for


def test_plan_from_config_alone_assumes_the_declared_mtp_layer(tmp_path, v3_dir):
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    shutil.copy(v3_dir / "config.json", only_config / "config.json")
    args = ModelArgs.from_dir(only_config)
    assert args.num_nextn_predict_layers == 1
    plan, source, with_mtp = plan_for(only_config, args, 1 << 40, 160, "int4", True, torch.float32)
    assert with_mtp and source.fmt.name == "int4"
    assert any("config.json alone" in n and "MTP" in n for n in plan.notes)
    # with the weights present the checkpoint decides: the fixture has no MTP tensors
    plan, _, with_mtp = plan_for(v3_dir, args, 1 << 40, 160, "int4", True, torch.float32)
    assert not with_mtp and any("no MTP weights" in n for n in plan.notes)
    assert plan.total_experts < plan_for(only_config, args, 1 << 40, 160, "int4", True, torch.float32)[0].total_experts


def test_a_checkpoint_without_tokenizer_loads_for_token_ids(tmp_path, v3_dir):
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(v3_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    notes = []
    llm = dsv3lite.load(bare, device="cpu", progress=False, log=notes.append)
    ref = dsv3lite.load(v3_dir, device="cpu", progress=False, log=lambda m: None)
    assert llm.tokenizer is None and any("no tokenizer.json" in n for n in notes)
    ids = [1, 5, 9, 42, 7]
    torch.testing.assert_close(llm.forward([ids]), ref.forward([ids]), rtol=0, atol=0)
    got = [c.token_id for c in llm.generate(ids, max_tokens=6)]
    assert got == [c.token_id for c in ref.generate(ids, max_tokens=6)] and len(got) >= 1
    with pytest.raises(UserError, match="needs a tokenizer"):
        list(llm.generate("hello", max_tokens=2))
    with pytest.raises(UserError, match="needs a tokenizer"):
        list(llm.chat([{"role": "user", "content": "hi"}], max_tokens=2))


def test_no_mtp_loads_no_mtp_layer_and_no_mtp_cache():
    with_mtp = dsv3lite.load(device="cpu", progress=False, log=lambda m: None, mtp_adaptive=False)
    without = dsv3lite.load(device="cpu", mtp=False, progress=False, log=lambda m: None)
    assert with_mtp.model.mtp is not None and without.model.mtp is None
    n_params = lambda llm: sum(p.numel() for p in llm.model.parameters())
    assert n_params(without) < n_params(with_mtp)
    want = [c.token_id for c in with_mtp.generate("ROMEO:", max_tokens=12)]
    assert [c.token_id for c in without.generate("ROMEO:", max_tokens=12)] == want
    assert len(without.cache) == without.args.num_hidden_layers < len(with_mtp.cache)
    assert without.stats()["mtp"]["enabled"] is False


def test_a_cuda_budget_keeps_a_reserve_and_names_the_largest_that_works(monkeypatch):
    from dsv3lite.offload import setup

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(78.5 * gib), int(79.6 * gib)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda")
    assert setup.resolve_budget("40G", cuda) == 40 * gib - setup.CUDA_RESERVE_BYTES       # planned inside the budget
    assert setup.resolve_budget("auto", cuda) == int(78.5 * gib) - setup.CUDA_RESERVE_BYTES
    with pytest.raises(UserError, match=r"80\.00 GiB exceeds this GPU's total: the largest that works here is 78\.50 GiB"):
        setup.resolve_budget("80G", cuda)
    with pytest.raises(UserError, match="what is free"):
        setup.resolve_budget("79G", cuda)
    with pytest.raises(UserError, match="leaves nothing"):
        setup.resolve_budget("1G", cuda)


def test_read_ahead_gives_each_tensor_as_weight_does_in_order_and_stops_early(tmp_path):
    """TensorReader.weights: a background thread reads ahead within its byte budget; the tensors (FP8 ones with
    their scale_inv) equal one-at-a-time reads, in the caller's order; an error belongs to its tensor; breaking
    out of the loop stops the reads."""
    from dsv3lite.hf_checkpoint import CheckpointIndex, TensorReader
    from dsv3lite.testing import write_checkpoint, write_fp8_copy

    path = write_fp8_copy(write_checkpoint(tmp_path / "m", "v3fp8"), tmp_path / "fp8")
    index = CheckpointIndex.open(path)
    names = sorted(n for n in index.files if not n.endswith("_scale_inv"))[::-1]
    with TensorReader(index) as one, TensorReader(index) as ahead:
        expected = [(n, *one.weight(n)) for n in names]
        assert any(s is not None for _, _, s in expected)
        for budget in (1, 1 << 16, 1 << 30):
            got = list(ahead.weights(names, ahead_bytes=budget))
            assert [g[0] for g in got] == names
            for (n, w, s), (_, w2, s2) in zip(expected, got):
                assert torch.equal(w.view(torch.uint8), w2.view(torch.uint8)), n
                assert (s is None and s2 is None) or torch.equal(s, s2)
        it = ahead.weights(names)
        next(it)
        it.close()                                      # leaving early: the pool shuts down, nothing hangs
        index.files["no.such.tensor"] = index.files[names[0]]
        seen = []
        with pytest.raises(UserError, match="does not hold no.such.tensor"):
            for n, _, _ in ahead.weights([names[0], "no.such.tensor"]):
                seen.append(n)
        assert seen == [names[0]]
