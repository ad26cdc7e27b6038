"""Train the bundled demo model (dsv3lite/demo): a small DeepSeek-V3-architecture MoE on Shakespeare's plays.

    python scripts/train_tiny.py train                # ~50 min on 2 CPU cores; writes dsv3lite/demo/
    python scripts/train_tiny.py train --device cuda  # same recipe, bf16 autocast
    python scripts/train_tiny.py bench                # tokens/s, expert-module check, optional --profile
    python scripts/eval_demo.py                       # the figures the model card quotes

The network is dsv3lite's own `Transformer(args, with_mtp=True)` in training mode. The recipe follows
the DeepSeek-V3 report: next-token loss plus 0.3 x the MTP loss (the MTP layer reads the main model's
final-normed hidden h_i and token t_{i+1} and predicts t_{i+2}), auxiliary-loss-free balancing (after
each step every router's bias moves by gamma * sign(mean load - load)), and a tiny sequence-wise
balance loss. Batches mix plain play windows (starting with BOS) and packed chat conversations
(loss on the assistant replies and their EOS only).

For speed, each MoE's routed experts (the `MoE.experts` seam) are replaced during training by
`TrainExperts`: the same weights (w1/w3 [E, I, D], w2 [E, D, I]) and the same math, computed with
three batched matmuls over a padded [E, capacity, D] buffer. Export copies the weights into a stock
model and writes HF tensor names with `checkpoint_state_dict`.

Deterministic for a given --seed and device (fixed step count, seeded init and data order; on CUDA
through torch's deterministic mode). Needs the corpus from scripts/prepare_corpus.py in --data.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# OpenMP threads that spin while waiting stall badly when other processes share the cores (measured
# 5x slower here); waiting passively costs little when the machine is otherwise idle.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting, which is read when torch loads)
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from dsv3lite.config import ModelArgs
from dsv3lite.hf_checkpoint import checkpoint_state_dict
from dsv3lite.model import Gate, RoutedExperts, Transformer, init_weights
from dsv3lite.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO / "dsv3lite" / "demo"
DATA_DIR = REPO / "scripts" / "data"
IGNORE = -100

# The demo architecture (HF config.json names). v_head_dim = qk_nope + qk_rope lets CPU SDPA use its
# fused kernel; 32 experts x 64 wide keeps the bf16 checkpoint under 30 MB.
DEMO_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 1,           # layer 0 dense, layers 1-5 MoE (and the MTP layer)
    "intermediate_size": 768,             # dense MLP width
    "num_attention_heads": 4,
    "num_key_value_heads": 4,             # unused by MLA; transformers wants it
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 48,
    "n_routed_experts": 32,
    "moe_intermediate_size": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,      # yarn factor 4 over the 512-token training context
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def hf_config(cfg: dict = DEMO_CONFIG) -> dict:
    """config.json as the hub writes DeepSeek-V3's: readable by ModelArgs.from_dir and DeepseekV3Config."""
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **cfg,
            "moe_layer_freq": 1, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- training-time routed experts -----------------------------------------------------------------

class TrainExperts(nn.Module):
    """Routed experts for training: RoutedExperts' weights and math, computed in bulk.

    Assignments are sorted by expert. When the load is even enough, they are scattered into a padded
    [E, capacity, D] buffer and gate/up/down run as three bmm calls; under a skewed load (early
    training) the padding would waste more than it saves, so each expert's contiguous slice runs as
    plain matmuls. Either way the weighted outputs are summed per token in ascending expert id.
    """

    PAD_LIMIT = 1.3          # use the padded buffer while E * capacity <= 1.3 * assignments

    def __init__(self, n_experts: int, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter, dim))   # gate_proj
        self.w3 = nn.Parameter(torch.empty(n_experts, inter, dim))   # up_proj
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter))   # down_proj
        self.force: str | None = None                                 # "padded" | "sliced" (tests)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n_experts, k = self.w1.shape[0], ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)             # assignments grouped by expert, ascending
        expert = flat[order]
        token = order // k
        counts = torch.bincount(flat, minlength=n_experts)
        w = weights.flatten()[order][:, None]
        xs = x.index_select(0, token)                         # [N*K, D]
        capacity = int(counts.max())
        padded = self.force == "padded" or (self.force is None and (
            x.is_cuda or n_experts * capacity <= self.PAD_LIMIT * flat.numel()))
        if padded:
            rank = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[expert]
            slot = expert * capacity + rank
            buf = xs.new_zeros(n_experts * capacity, x.shape[1]).index_copy(0, slot, xs)
            buf = buf.view(n_experts, capacity, -1)          # [E, C, D]
            h = F.silu(torch.bmm(buf, self.w1.transpose(1, 2))) * torch.bmm(buf, self.w3.transpose(1, 2))
            y = torch.bmm(h, self.w2.transpose(1, 2)).view(n_experts * capacity, -1).index_select(0, slot)
        else:
            parts = []
            for e, xe in enumerate(xs.split(counts.tolist())):
                if xe.shape[0]:
                    parts.append(F.linear(F.silu(F.linear(xe, self.w1[e])) * F.linear(xe, self.w3[e]), self.w2[e]))
            y = torch.cat(parts)
        return torch.zeros_like(x).index_add_(0, token, (y * w).to(x.dtype))


def swap_experts(model: Transformer, cls) -> None:
    """Replace every MoE's routed-expert module by `cls`, keeping the same parameter tensors."""
    for moe in model.moe_modules():
        old = moe.experts
        new = cls(*old.w1.shape[:1], old.w1.shape[2], old.w1.shape[1])
        new.w1, new.w3, new.w2 = old.w1, old.w3, old.w2
        moe.experts = new


def fp32_routers(model: Transformer) -> None:
    """Keep router scores in fp32 under autocast (the network computes them in fp32 by design)."""
    for mod in model.modules():
        if isinstance(mod, Gate):
            def scores(x, gate=mod):
                with torch.autocast(x.device.type, enabled=False):
                    return Gate.scores(gate, x)
            mod.scores = scores


# --- data ------------------------------------------------------------------------------------------

class Batches:
    """Training rows of T+2 tokens (inputs T, targets shifted by 1 and 2) and their loss masks.

    Play rows: BOS + a window of train.txt at a random token offset. Chat rows: conversations from
    chat_train.jsonl rendered with the chat template, packed back to back (the last one cut off);
    only assistant replies and their EOS are targets. The first `chat_rows` rows of each batch are chat.
    """

    def __init__(self, tokenizer: Tokenizer, data: Path, seq_len: int, batch: int, chat_rows: int, seed: int,
                 quiet: bool = False):
        self.T, self.B, self.chat_rows = seq_len, batch, chat_rows
        self.bos = tokenizer.bos_id
        assistant = tokenizer.encode("<｜Assistant｜>")
        assert len(assistant) == 1, assistant
        self.tokenizer, self.assistant_id = tokenizer, assistant[0]
        t0 = time.perf_counter()
        self.play = torch.tensor(tokenizer.encode((data / "train.txt").read_text(encoding="utf-8")))
        # conversations are tokenized when first drawn (a run uses a fraction of them)
        self.chats = [json.loads(line)["messages"]
                      for line in (data / "chat_train.jsonl").read_text(encoding="utf-8").splitlines()]
        self.encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if not quiet:
            log(f"data: {len(self.play):,} play tokens, {len(self.chats):,} chats in {time.perf_counter() - t0:.1f}s")
        self.gen = torch.Generator().manual_seed(seed)
        self.chat_order: list[int] = []
        self.chat_pos = 0

    def state(self) -> dict:
        return {"gen": self.gen.get_state(), "chat_order": self.chat_order, "chat_pos": self.chat_pos}

    def load_state(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.chat_order, self.chat_pos = list(state["chat_order"]), int(state["chat_pos"])

    def _next_chat(self):
        if self.chat_pos >= len(self.chat_order):
            self.chat_order = torch.randperm(len(self.chats), generator=self.gen).tolist()
            self.chat_pos = 0
        self.chat_pos += 1
        index = self.chat_order[self.chat_pos - 1]
        if index not in self.encoded:
            ids = self.tokenizer.encode_chat(self.chats[index], add_generation_prompt=False)
            start = len(ids) - ids[::-1].index(self.assistant_id)      # first token of the reply
            self.encoded[index] = torch.tensor(ids), torch.arange(len(ids)) >= start
        return self.encoded[index]

    def _chat_row(self):
        ids, mask, n = [], [], 0
        while n < self.T + 2:
            i, m = self._next_chat()
            ids.append(i)
            mask.append(m)
            n += len(i)
        return torch.cat(ids)[:self.T + 2], torch.cat(mask)[:self.T + 2]

    def _play_row(self):
        start = int(torch.randint(0, len(self.play) - self.T - 1, (1,), generator=self.gen))
        ids = torch.cat([torch.tensor([self.bos]), self.play[start:start + self.T + 1]])
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> tokens [B, T+2] (long), target mask [B, T+2] (bool)."""
        rows = [self._chat_row() if r < self.chat_rows else self._play_row() for r in range(self.B)]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


# --- losses ----------------------------------------------------------------------------------------

def seq_balance_sum(routing: tuple[torch.Tensor, torch.Tensor], batch: int, seq_len: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance term sum_e f_e * P_e of one MoE, summed over the sequences.

    f_e = E / (K T) * (tokens of the sequence routed to e); P_e = mean over the sequence of the
    normalised affinity s_e / sum_j s_j (the unbiased sigmoid scores)."""
    scores, ids = routing
    n_experts = scores.shape[-1]
    probs = (scores / scores.sum(-1, keepdim=True)).view(batch, seq_len, n_experts).mean(1)
    counts = torch.zeros(batch, n_experts, device=ids.device)
    counts.scatter_add_(1, ids.view(batch, -1), torch.ones(ids.numel(), device=ids.device).view(batch, -1))
    f = counts * (n_experts / (top_k * seq_len))
    return (f * probs).sum()


def loss_norms(mask: torch.Tensor) -> tuple[int, int, int]:
    """(next-token targets, MTP targets, sequences) of a whole batch: what its losses are averaged over."""
    seq_len = mask.shape[1] - 2
    return int(mask[:, 1:seq_len + 1].sum()), int(mask[:, 2:].sum()), mask.shape[0]


def compute_losses(model: Transformer, tokens: torch.Tensor, mask: torch.Tensor, norms: tuple[int, int, int]):
    """tokens/mask [b, T+2] (a batch or this process's rows of it) -> (next-token loss, MTP loss, balance
    term summed over MoE layers), each summed here and divided by the whole batch's `norms`."""
    bsz, total = tokens.shape
    seq_len = total - 2
    inputs, next_tokens = tokens[:, :seq_len], tokens[:, 1:seq_len + 1]
    y1 = next_tokens.masked_fill(~mask[:, 1:seq_len + 1], IGNORE)
    y2 = tokens[:, 2:].masked_fill(~mask[:, 2:], IGNORE)
    h = model.hidden(inputs)                                       # final-normed [b, T, D]
    logits = model.head(h).flatten(0, 1).float()
    main = F.cross_entropy(logits, y1.flatten(), ignore_index=IGNORE, reduction="sum") / norms[0]
    h_mtp = model.mtp_hidden(h, next_tokens)                      # pairs (h_i, t_{i+1}) -> t_{i+2}
    logits = model.head(h_mtp).flatten(0, 1).float()
    mtp = F.cross_entropy(logits, y2.flatten(), ignore_index=IGNORE, reduction="sum") / norms[1]
    k = model.args.num_experts_per_tok
    balance = sum(seq_balance_sum(model.last_routing[moe.layer_id], bsz, seq_len, k)
                  for moe in model.moe_modules()) / norms[2]
    return main, mtp, balance


def expert_loads(model: Transformer) -> torch.Tensor:
    """Tokens per routed expert in the last forward, [n_moe, E] (float), from the recorded routing."""
    loads = []
    for moe in model.moe_modules():
        _, ids = model.last_routing[moe.layer_id]
        loads.append(torch.bincount(ids.flatten(), minlength=moe.gate.bias.numel()).float())
    model.last_routing.clear()
    return torch.stack(loads)


@torch.no_grad()
def update_router_bias(model: Transformer, loads: torch.Tensor, gamma: float) -> torch.Tensor:
    """Aux-loss-free balancing: bias_e += gamma * sign(mean load - load_e) per router, from the whole
    batch's loads [n_moe, E]. -> max/mean load per layer."""
    for moe, load in zip(model.moe_modules(), loads):
        moe.gate.bias.add_(gamma * torch.sign(load.mean() - load))
    return loads.max(1).values / loads.mean(1)


def bias_gamma_at(step: int, args) -> float:
    """Router-bias update speed: from --bias-gamma-start down to --bias-gamma over the first
    --bias-gamma-steps steps. A short run cannot wait for 1e-3 steps to undo the skew of a random
    router (measured: max/mean load still ~4-6 after 100 steps at 1e-3, ~1.5 at 1e-2)."""
    if step >= args.bias_gamma_steps:
        return args.bias_gamma
    t = step / args.bias_gamma_steps
    return args.bias_gamma_start + (args.bias_gamma - args.bias_gamma_start) * t


def lr_at(step: int, total_steps: int, args) -> float:
    """Warmup-stable-decay: linear warmup, constant, then linear decay to min_lr_ratio * lr over the
    last decay_steps steps. Before the decay starts the rate does not depend on total_steps, which is
    what lets --time-budget pick total_steps during the run (see `train`)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_start = total_steps - args.decay_steps
    if step < decay_start:
        return args.lr
    progress = (step - decay_start + 1) / args.decay_steps
    return args.lr * (1 - (1 - args.min_lr_ratio) * progress)


# --- model, optimizer, checkpoints -----------------------------------------------------------------

def build_model(seed: int, device: torch.device) -> Transformer:
    args = ModelArgs.from_dict(hf_config())
    torch.manual_seed(seed)
    model = init_weights(Transformer(args, with_mtp=True)).to(device)
    swap_experts(model, TrainExperts)
    model.last_routing = {}                 # MoE layer id -> (scores [N, E], ids [N, K]) of the last forward
    model.add_observer(on_routing=lambda layer_id, ids, scores: model.last_routing.__setitem__(layer_id, (scores, ids)))
    return model.train()


def make_optimizer(model: Transformer, lr: float, weight_decay: float, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]     # norms
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def export(model: Transformer, out: Path) -> Path:
    """Write config.json, generation_config.json and model.safetensors (bf16; router bias fp32) into `out`."""
    from safetensors.torch import save_file

    args = model.args
    with torch.device("meta"):
        stock = Transformer(args, with_mtp=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    stock.load_state_dict(state, assign=True, strict=True)             # TrainExperts -> RoutedExperts
    assert all(isinstance(m.experts, RoutedExperts) for m in stock.moe_modules())
    tensors = {}
    for name, t in checkpoint_state_dict(stock).items():
        dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        tensors[name] = t.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(hf_config(), indent=2) + "\n")
    generation = {"bos_token_id": DEMO_CONFIG["bos_token_id"], "eos_token_id": DEMO_CONFIG["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out / "model.safetensors"


@torch.no_grad()
def quick_val_loss(model: Transformer, windows: torch.Tensor, autocast) -> float:
    """Mean next-token loss on fixed validation windows [n, T+1] (a progress signal, not the card's figure)."""
    total = 0.0
    for row in windows.split(4):
        with autocast:
            logits = model.head(model.hidden(row[:, :-1]))
        total += F.cross_entropy(logits.flatten(0, 1).float(), row[:, 1:].flatten(), reduction="sum").item()
    return total / windows[:, 1:].numel()


def val_windows(tokenizer: Tokenizer, data: Path, seq_len: int, n: int) -> torch.Tensor | None:
    """The first n non-overlapping windows of val.txt, each BOS + seq_len tokens; None without val.txt."""
    path = data / "val.txt"
    if not path.exists():
        return None
    ids = torch.tensor(tokenizer.encode(path.read_text(encoding="utf-8")))[:n * seq_len].view(n, seq_len)
    return torch.cat([torch.full((n, 1), tokenizer.bos_id), ids], dim=1)


def save_state(path: Path, model, opt, batches: Batches, step: int, elapsed: float, extra: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "data": batches.state(),
                "step": step, "elapsed": elapsed, **extra}, tmp)
    tmp.replace(path)


# --- commands --------------------------------------------------------------------------------------

def setup_device(args) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
    return device


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train(args) -> int:
    """Train for --steps steps, or fewer when --time-budget says the run must start its decay earlier.

    On CPU the batch is split over --procs single-threaded processes (gloo all-reduce of the gradients
    and of the expert loads): one barrier per step instead of one per operator, which keeps the speed
    when other programs share the cores. With a time budget the schedule stays deterministic: the
    stable phase runs until the projected end of the decay phase (at the recent step time) would reach
    the budget; total_steps is then fixed at that step + decay_steps and written to summary.json, and
    `--steps <that number>` without a budget replays the same run (same --procs and --threads)."""
    args.t0 = time.time()
    if args.device == "cpu" and args.procs > 1:
        torch.multiprocessing.spawn(train_worker, args=(args, free_port()), nprocs=args.procs, join=True)
        return 0
    args.procs = 1
    return train_worker(0, args, None)


def train_worker(rank: int, args, port: int | None) -> int:
    import torch.distributed as dist

    world, lead = args.procs, rank == 0
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    say = log if lead else (lambda msg: None)
    device = setup_device(args)
    tokenizer = Tokenizer.from_dir(args.tokenizer)
    batches = Batches(tokenizer, args.data, args.seq_len, args.batch, args.chat_rows, args.seed, quiet=not lead)
    model = build_model(args.seed, device)
    fp32_routers(model)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    budget = f", time budget {args.time_budget:g} min" if args.time_budget else ""
    say(f"model: {n_params / 1e6:.2f}M parameters; up to {args.steps} steps x {args.batch} x {args.seq_len} tokens "
        f"({args.chat_rows} chat rows per batch) on {device}, {world} process(es) x {args.threads} thread(s){budget}")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    state_file = args.run_dir / "train_state.pt"
    step, total_steps, elapsed_before = 0, args.steps, 0.0
    decided = args.time_budget is None                   # total_steps fixed (no budget, or decay started)
    if args.resume and state_file.exists():
        state = torch.load(state_file, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        batches.load_state(state["data"])
        step, elapsed_before = state["step"], state["elapsed"]
        total_steps, decided = state["total_steps"], decided or state["decided"]
        say(f"resumed at step {step} ({elapsed_before / 60:.1f} min trained before)")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    val = val_windows(tokenizer, args.data, args.seq_len, args.val_windows) if lead else None
    val = val.to(device) if val is not None else None
    metrics_file = (args.run_dir / "metrics.jsonl").open("a") if lead else None
    last_save, step_times = time.perf_counter(), []
    elapsed = lambda: elapsed_before + time.time() - args.t0   # noqa: E731

    def checkpoint():
        if lead:
            save_state(state_file, model, opt, batches, step, elapsed(),
                       {"total_steps": total_steps, "decided": decided})

    while step < total_steps:
        t_step = time.perf_counter()
        tokens, mask = batches.next()
        norms = loss_norms(mask)
        tokens, mask = tokens[rank::world].to(device), mask[rank::world].to(device)   # this process's rows
        lr = lr_at(step, total_steps, args)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            main, mtp, balance = compute_losses(model, tokens, mask, norms)
            loss = main + args.mtp_weight * mtp + args.balance_alpha * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            for p, g in zip(params, flat.split([p.numel() for p in params])):
                p.grad = g.view_as(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        start_decay = 0.0
        if lead and not decided and step + 1 >= args.warmup:
            recent = sorted(step_times[-30:] + [time.perf_counter() - t_step])
            recent = recent[len(recent) // 2]                                       # median step time
            if elapsed() + args.decay_steps * recent * 1.05 + args.reserve >= args.time_budget * 60:
                start_decay = 1.0
        # one small all-reduce per step: losses for the log, the decision, and the expert loads
        stats = torch.cat([torch.stack([main.detach(), mtp.detach(), balance.detach()]).float().cpu(),
                           torch.tensor([start_decay]), expert_loads(model).flatten().cpu()])
        if world > 1:
            dist.all_reduce(stats)
        loads = stats[4:].view(len(model.moe_modules()), -1)
        load_ratio = update_router_bias(model, loads.to(device), bias_gamma_at(step, args))
        step += 1
        if not decided and (stats[3] > 0 or step + args.decay_steps >= total_steps):
            total_steps, decided = min(total_steps, step + args.decay_steps), True
            say(f"step {step}: decay starts; the run ends at step {total_steps} ({elapsed() / 60:.1f} min spent)")
        step_times.append(time.perf_counter() - t_step)
        if lead and (step % args.log_every == 0 or step == total_steps):
            window = step_times[-args.log_every:]
            rate = args.batch * args.seq_len * len(window) / sum(window)
            rec = {"step": step, "lr": lr, "loss": stats[0].item(), "mtp": stats[1].item(), "balance": stats[2].item(),
                   "grad_norm": grad_norm.item(), "max_load": load_ratio.max().item(),
                   "load_per_layer": [round(r, 2) for r in load_ratio.tolist()], "tok_s": rate,
                   "elapsed_min": elapsed() / 60}
            if val is not None and (step % args.val_every == 0 or step == total_steps):
                rec["val_loss"] = quick_val_loss(model, val, autocast)
                say(f"step {step:5d}  quick val loss {rec['val_loss']:.3f} ({val.shape[0]} windows)")
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            say(f"step {step:5d}  lr {lr:.2e}  loss {rec['loss']:.3f}  mtp {rec['mtp']:.3f}  "
                f"bal {rec['balance']:.3f}  gnorm {rec['grad_norm']:.2f}  max/mean load {rec['load_per_layer']}  "
                f"{rate:,.0f} tok/s  {rec['elapsed_min']:.1f} min")
        if time.perf_counter() - last_save > args.save_every * 60 and step < total_steps:
            checkpoint()
            last_save = time.perf_counter()
            say(f"saved {state_file} at step {step}")
    checkpoint()
    if lead:
        path = export(model.cpu(), args.out)
        summary = {"steps": step, "decay_steps": args.decay_steps, "tokens": step * args.batch * args.seq_len,
                   "wall_min": round(elapsed() / 60, 2), "device": str(device), "procs": world,
                   "threads": args.threads if device.type == "cpu" else None, "seed": args.seed, "params": n_params,
                   "safetensors_bytes": path.stat().st_size,
                   "replay": f"python scripts/train_tiny.py train --steps {step} --decay-steps {args.decay_steps} "
                             f"--seed {args.seed} --batch {args.batch} --chat-rows {args.chat_rows} --lr {args.lr:g} "
                             f"--procs {world} --threads {args.threads}"}
        (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB); trained {step} steps in {elapsed() / 60:.1f} min")
    if world > 1:
        dist.destroy_process_group()
    return 0


def bench(args) -> int:
    """Check TrainExperts against RoutedExperts, then time training steps (optionally under torch.profiler)."""
    device = setup_device(args)
    torch.manual_seed(0)
    e, d, i, k, n = 32, 256, 64, 4, 1024
    stock = RoutedExperts(e, d, i)
    for p in stock.parameters():
        nn.init.normal_(p, std=0.05)
    fast = TrainExperts(e, d, i)
    fast.w1, fast.w3, fast.w2 = stock.w1, stock.w3, stock.w2
    x, w = torch.randn(n, d), torch.rand(n, k)
    for skew in (0.0, 2.0):
        ids = (torch.randn(n, e) + skew * torch.linspace(0, 1, e)).topk(k, -1).indices
        ref = stock(x, ids, w)
        for mode in ("padded", "sliced"):
            fast.force = mode
            diff = (fast(x, ids, w) - ref).abs().max().item()
            log(f"TrainExperts ({mode}, skew {skew}) vs RoutedExperts: max |diff| {diff:.2e}")
            assert diff < 1e-5
    fast.force = None

    tokenizer = Tokenizer.from_dir(args.tokenizer)
    batches = Batches(tokenizer, args.data, args.seq_len, args.batch, args.chat_rows, args.seed)
    model = build_model(args.seed, device)
    fp32_routers(model)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def one_step():
        tokens, mask = (t.to(device) for t in batches.next())
        with autocast:
            main, mtp, balance = compute_losses(model, tokens, mask, loss_norms(mask))
            loss = main + args.mtp_weight * mtp + args.balance_alpha * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        update_router_bias(model, expert_loads(model), bias_gamma_at(0, args))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return main.item()

    for _ in range(2):
        one_step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.bench_steps):
                one_step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    times = []
    for _ in range(args.bench_steps):
        t0 = time.perf_counter()
        loss = one_step()
        times.append(time.perf_counter() - t0)
    tok = args.batch * args.seq_len
    log(f"step time median {sorted(times)[len(times) // 2]:.2f}s  min {min(times):.2f}s  -> "
        f"{tok / sorted(times)[len(times) // 2]:,.0f} tok/s (median), loss {loss:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("command", choices=["train", "bench"], nargs="?", default="train")
    ap.add_argument("--data", type=Path, default=DATA_DIR, help="folder with train.txt and chat_train.jsonl")
    ap.add_argument("--tokenizer", type=Path, default=DEMO_DIR, help="folder with the demo tokenizer")
    ap.add_argument("--out", type=Path, default=DEMO_DIR, help="where the trained checkpoint is written")
    ap.add_argument("--run-dir", type=Path, default=REPO / "runs" / "demo",
                    help="training state (resumable) and metrics.jsonl")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--procs", type=int, default=2, help="CPU: processes sharing each batch (data parallel)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000, help="total steps (at most, with --time-budget)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="minutes for the whole run: start the decay so that it ends within them")
    ap.add_argument("--reserve", type=float, default=30.0, help="seconds kept for the export at the end")
    ap.add_argument("--batch", type=int, default=8, help="rows per step")
    ap.add_argument("--chat-rows", type=int, default=2, help="rows per step that hold chat conversations")
    ap.add_argument("--seq-len", type=int, default=512, help="training context (tokens)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="learning rate at the end / --lr")
    ap.add_argument("--decay-steps", type=int, default=200, help="length of the final linear decay")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="router bias update speed")
    ap.add_argument("--bias-gamma-start", type=float, default=1e-2, help="bias update speed at step 0")
    ap.add_argument("--bias-gamma-steps", type=int, default=300, help="steps from the start speed to --bias-gamma")
    ap.add_argument("--balance-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--val-every", type=int, default=200, help="steps between quick validation losses")
    ap.add_argument("--val-windows", type=int, default=16, help="windows of val.txt in the quick validation")
    ap.add_argument("--save-every", type=float, default=10.0, help="minutes between training-state saves")
    ap.add_argument("--resume", action="store_true", help="continue from run-dir/train_state.pt")
    ap.add_argument("--bench-steps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="bench: print a torch.profiler table")
    args = ap.parse_args(argv)
    return train(args) if args.command == "train" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
