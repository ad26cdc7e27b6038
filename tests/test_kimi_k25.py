"""Kimi-K2.5: the language model of a multimodal checkpoint (text_config nesting, language_model.* tensor names,
the vision tower left out) against transformers, and Kimi's chat template."""
from __future__ import annotations

import json

import pytest
import torch

import dsv3lite
from dsv3lite.config import ModelArgs
from dsv3lite.errors import UserError
from dsv3lite.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def k25_dir(tmp_path_factory):
    from dsv3lite.testing import write_kimi_k25_checkpoint

    return write_kimi_k25_checkpoint(tmp_path_factory.mktemp("ckpt-kimi-k25"))


@torch.no_grad()
def test_text_logits_match_transformers(k25_dir):
    from transformers import Kimi_K25ForConditionalGeneration

    hf = Kimi_K25ForConditionalGeneration.from_pretrained(k25_dir, dtype=torch.float32,
                                                          experts_implementation="eager").eval()
    notes = []
    model = load_model(k25_dir, torch.device("cpu"), torch.float32, progress=False, log=notes.append)
    x = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(x), hf(input_ids=x).logits, atol=1e-4, rtol=1e-4)
    # the vision tower and projector are named in one line, and nothing of them is loaded
    assert [n for n in notes if "vision_tower" in n] == [n for n in notes if "mm_projector" in n] and \
        len([n for n in notes if "vision_tower" in n]) == 1
    assert not any("vision" in name or "projector" in name for name, _ in model.named_parameters())


def test_config_is_the_text_config_with_the_top_level_ids(k25_dir):
    cfg = json.loads((k25_dir / "config.json").read_text())
    a = ModelArgs.from_dir(k25_dir)
    text = cfg["text_config"]
    assert a.model_type == "kimi_k25" and text["model_type"] == "kimi_k2"
    assert (a.hidden_size, a.num_hidden_layers, a.n_routed_experts) == (text["hidden_size"],
                                                                        text["num_hidden_layers"],
                                                                        text["n_routed_experts"])
    assert a.routed_scaling_factor == pytest.approx(2.827) and a.beta_fast == 1.0 and not a.has_indexer
    top = dict(cfg, text_config={k: v for k, v in text.items() if k != "eos_token_id"}, eos_token_id=[1, 5])
    assert ModelArgs.from_dict(top).stop_ids() == {1, 5}
    with pytest.raises(UserError, match="text_config"):
        ModelArgs.from_dict({"model_type": "kimi_k25"})
    with pytest.raises(UserError, match="deepseek_v2"):
        ModelArgs.from_dict(dict(cfg, text_config=dict(text, model_type="deepseek_v2")))
    # a compressed-tensors config without a scheme is refused wherever it is declared (the released int4 one is
    # served: tests/test_kimi_int4.py)
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    for declared in (dict(cfg, quantization_config=int4), dict(cfg, text_config=dict(text, quantization_config=int4))):
        with pytest.raises(UserError, match="compressed-tensors"):
            ModelArgs.from_dict(declared)


def test_chat_uses_kimis_template_and_generates(k25_dir):
    llm = dsv3lite.load(k25_dir, device="cpu", ctx_size=96, progress=False, log=lambda m: None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    text = llm.tokenizer.apply_chat_template(messages)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>hello"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    ids = llm.tokenizer.encode_chat(messages)
    middle = llm.tokenizer.encode("<|im_middle|>")
    assert len(middle) == 1 and ids.count(middle[0]) == 3              # the markers are single special tokens
    llm.stop_ids = set()
    chunks = list(llm.chat(messages, max_tokens=8))
    assert len(chunks) == 8 and chunks[-1].finish_reason == "length"


def test_quantize_reads_the_language_model_by_its_own_names(k25_dir, tmp_path):
    from dsv3lite.quant.checkpoint import quantize_checkpoint

    dst = quantize_checkpoint(k25_dir, tmp_path / "k25-bf16", experts="bf16", progress=False, log=lambda m: None)
    x = torch.randint(0, 400, (1, 16), generator=torch.Generator().manual_seed(1))
    quiet = dict(device="cpu", progress=False, log=lambda m: None)
    got, want = dsv3lite.load(dst, **quiet).forward(x), dsv3lite.load(k25_dir, **quiet).forward(x)
    # the quantized directory keeps its dense weights in bf16: logits within bf16 rounding of the fp32 original
    torch.testing.assert_close(got, want, atol=6e-2, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
