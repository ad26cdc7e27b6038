"""Evaluate the bundled demo model: the figures its model card (dsv3lite/demo/README.md) quotes.

    python scripts/eval_demo.py [--weights dsv3lite/demo] [--data scripts/data] [--json runs/demo/eval.json]

Everything runs through the runtime (`dsv3lite.load(..., device="cpu", dtype="float32")`) on the
exported checkpoint:
  - validation loss on val.txt (held-out whole scenes): windows of the 512-token training context,
    each BOS + up to 511 tokens, sliding by 256 so every scored token has at least 255 tokens of
    context; perplexity per token and bits per character (total nats / characters / ln 2);
  - loss on the assistant replies of the first --chat-examples conversations of chat_val.jsonl;
  - MTP: how often the MTP layer's top-1 for t_{i+2} equals the main model's top-1 at position i+1
    (the greedy acceptance rate of one-token MTP drafts), and its accuracy against the text;
  - expert load balance: max / mean tokens per routed expert, per MoE layer, on the scored tokens;
  - the reference slice: the perplexity of a fixed piece of validation text (printed, for the card
    and tests/test_demo.py, which recomputes it without the corpus);
  - sample generations and the logits difference against transformers' DeepseekV3ForCausalLM.
Deterministic: greedy decoding, seeded sampling, fp32 on 2 CPU threads.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dsv3lite

REPO = Path(__file__).resolve().parent.parent
CONTEXT, STRIDE = 512, 256
SLICE_CHARS = 1000            # the reference slice: the first paragraphs of val.txt up to this many characters
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo!"]
CHATS = [
    [{"role": "user", "content": "Good morrow, sweet lady. Whither goest thou so early?"}],
    [{"role": "user", "content": "HAMLET:\nWhat news, my lord? How fares the king?"}],
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def windows(n_targets: int):
    """Yield (lo, c, e) over the tokens full[1..n] of full = [BOS] + ids: the window's input is
    [BOS] + full[lo:e-1] (at most CONTEXT tokens) and it scores targets full[c:e]."""
    c = 1
    while c <= n_targets:
        e = min(c + STRIDE, n_targets + 1)
        yield max(1, e - CONTEXT), c, e
        c = e


@torch.no_grad()
def validation(llm, ids: list[int], n_chars: int, batch: int = 8) -> dict:
    model = llm.model
    bos = llm.tokenizer.bos_id
    full = torch.tensor([bos] + ids)
    moes = model.moe_modules()
    last: dict[int, torch.Tensor] = {}          # MoE layer id -> ids [N, K] of its last call
    watch = model.add_observer(on_routing=lambda layer_id, ids, scores: last.__setitem__(layer_id, ids))
    loads = [torch.zeros(moe.gate.weight.shape[0]) for moe in moes]
    nats, n_tok, main_hits, mtp_hits, mtp_agree, n_mtp = 0.0, 0, 0, 0, 0, 0
    spans = list(windows(len(ids)))
    # group windows of equal length so they run as one batch
    by_len: dict[int, list] = {}
    for lo, c, e in spans:
        by_len.setdefault(1 + (e - 1 - lo), []).append((lo, c, e))
    for length, group in sorted(by_len.items()):
        for b in range(0, len(group), batch):
            part = group[b:b + batch]
            seqs = torch.stack([torch.cat([full[:1], full[lo:e]]) for lo, c, e in part])   # [b, length + 1]
            x, y = seqs[:, :-1], seqs[:, 1:]
            h = model.hidden(x)
            logits = model.head(h).float()                             # [b, L, V]
            routing = [last[moe.layer_id].view(len(part), length, -1) for moe in moes[:-1]]
            mtp_logits = model.head(model.mtp_hidden(h, y)).float()   # position j predicts seqs[j + 2]
            routing.append(last[moes[-1].layer_id].view(len(part), length, -1))
            lp = F.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]
            main_top = logits.argmax(-1)
            mtp_top = mtp_logits.argmax(-1)
            for r, (lo, c, e) in enumerate(part):
                j0, j1 = c - lo, e - lo                                 # scored input positions
                nats -= lp[r, j0:j1].sum().item()
                n_tok += j1 - j0
                main_hits += (main_top[r, j0:j1] == y[r, j0:j1]).sum().item()
                m1 = min(j1, length - 1)                                # MTP needs position j + 1 in the window
                mtp_agree += (mtp_top[r, j0:m1] == main_top[r, j0 + 1:m1 + 1]).sum().item()
                mtp_hits += (mtp_top[r, j0:m1] == seqs[r, j0 + 2:m1 + 2]).sum().item()
                n_mtp += max(0, m1 - j0)
                for load, ids_l in zip(loads, routing):
                    load += torch.bincount(ids_l[r, j0:j1].flatten(), minlength=load.numel()).float()
    watch.remove()
    layer_ids = [moe.layer_id for moe in moes]
    balance = {f"layer {i}" + (" (MTP)" if i == model.args.mtp_layer_id else ""): round((l.max() / l.mean()).item(), 3)
               for i, l in zip(layer_ids, loads)}
    return {"tokens": n_tok, "chars": n_chars, "windows": len(spans), "loss_per_token": nats / n_tok,
            "perplexity": math.exp(nats / n_tok), "bits_per_char": nats / n_chars / math.log(2),
            "top1_accuracy": main_hits / n_tok, "mtp_agreement": mtp_agree / n_mtp,
            "mtp_accuracy": mtp_hits / n_mtp, "mtp_positions": n_mtp,
            "max_over_mean_load": balance, "max_over_mean_load_worst": max(balance.values())}


@torch.no_grad()
def chat_validation(llm, path: Path, n_examples: int) -> dict:
    tok = llm.tokenizer
    assistant = tok.encode("<｜Assistant｜>")[0]
    nats, n = 0.0, 0
    lines = path.read_text(encoding="utf-8").splitlines()[:n_examples]
    for line in lines:
        ids = tok.encode_chat(json.loads(line)["messages"], add_generation_prompt=False)
        start = len(ids) - ids[::-1].index(assistant)                # first reply token
        logits = llm.forward([ids])[0]
        lp = F.log_softmax(logits[start - 1:-1], -1).gather(-1, torch.tensor(ids[start:])[:, None])
        nats -= lp.sum().item()
        n += len(ids) - start
    return {"conversations": len(lines), "reply_tokens": n, "reply_loss_per_token": nats / n,
            "reply_perplexity": math.exp(nats / n)}


def reference_slice(val_text: str) -> str:
    """The first paragraphs of val.txt, at most SLICE_CHARS characters, joined by blank lines."""
    out = []
    for para in val_text.split("\n\n"):
        if len("\n\n".join(out + [para])) > SLICE_CHARS:
            break
        out.append(para)
    return "\n\n".join(out).strip("\n")


@torch.no_grad()
def slice_perplexity(llm, text: str) -> float:
    """Perplexity of `text` under the runtime: forward over BOS + text, every text token scored."""
    ids = llm.tokenizer.encode(text, add_bos=True)
    logits = llm.forward([ids])[0]
    return math.exp(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


def samples(llm) -> dict:
    out = {"generate": [], "chat": []}
    for prompt in PROMPTS:
        greedy = "".join(c.text for c in llm.generate(prompt, max_tokens=80))
        sampled = "".join(c.text for c in llm.generate(prompt, max_tokens=80, temperature=0.8, top_p=0.95, seed=1))
        out["generate"].append({"prompt": prompt, "greedy": greedy, "sampled_t0.8_p0.95_seed1": sampled})
    for messages in CHATS:
        llm.reset()
        reply = "".join(c.text for c in llm.chat(messages, max_tokens=80))
        out["chat"].append({"messages": messages, "greedy_reply": reply})
    return out


@torch.no_grad()
def transformers_parity(llm, weights: Path, ids: list[int]) -> dict:
    try:
        from transformers import AutoModelForCausalLM, DeepseekV3Config
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from dsv3lite.config import ModelArgs

    hf = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32, experts_implementation="eager").eval()
    x = torch.tensor([ids])
    diff = (hf(x).logits - llm.forward(x)).abs().max().item()
    cfg, args = DeepseekV3Config.from_pretrained(weights), ModelArgs.from_dir(weights)
    rope = cfg.rope_parameters
    pairs = {"rope_type": (args.rope_type, rope.get("rope_type")), "factor": (args.rope_factor, rope.get("factor")),
             "original_max_position_embeddings": (args.original_max_position_embeddings,
                                                  rope.get("original_max_position_embeddings")),
             "mscale": (args.mscale, rope.get("mscale")), "mscale_all_dim": (args.mscale_all_dim, rope.get("mscale_all_dim"))}
    for name in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "n_group",
                 "topk_group", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace", "routed_scaling_factor",
                 "max_position_embeddings", "num_nextn_predict_layers", "vocab_size", "tie_word_embeddings"):
        pairs[name] = (getattr(args, name), getattr(cfg, name))
    mismatched = {k: v for k, v in pairs.items() if v[0] != v[1]}
    return {"tokens": len(ids), "max_abs_logit_diff_fp32": diff, "config_fields_compared": len(pairs),
            "config_mismatches": mismatched}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--weights", type=Path, default=REPO / "dsv3lite" / "demo")
    ap.add_argument("--data", type=Path, default=REPO / "scripts" / "data", help="folder with val.txt, chat_val.jsonl")
    ap.add_argument("--json", type=Path, default=REPO / "runs" / "demo" / "eval.json", help="where to write the figures")
    ap.add_argument("--chat-examples", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    llm = dsv3lite.load(args.weights, device="cpu", dtype="float32", progress=False, log=lambda m: None)
    val_text = (args.data / "val.txt").read_text(encoding="utf-8")
    ids = llm.tokenizer.encode(val_text)
    report = {"weights": str(args.weights), "checkpoint_bytes": (args.weights / "model.safetensors").stat().st_size,
              "parameters": sum(p.numel() for p in llm.model.parameters())}
    report["validation"] = validation(llm, ids, len(val_text))
    log(f"validation done in {time.perf_counter() - t0:.0f}s")
    report["chat_validation"] = chat_validation(llm, args.data / "chat_val.jsonl", args.chat_examples)
    piece = reference_slice(val_text)
    report["reference_slice"] = {"text": piece, "chars": len(piece),
                                 "tokens": len(llm.tokenizer.encode(piece)),
                                 "perplexity": slice_perplexity(llm, piece)}
    report["samples"] = samples(llm)
    report["transformers"] = transformers_parity(llm, args.weights, llm.tokenizer.encode(val_text[:2000], add_bos=True)[:256])
    report["eval_seconds"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps(report, indent=2, ensure_ascii=False))
    log(f"wrote {args.json} in {report['eval_seconds']}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
