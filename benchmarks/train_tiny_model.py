"""Train the built-in demo model (or its draft) on synthetic tasks, deterministically from a seed, on CPU.

    python benchmarks/train_tiny_model.py --out /tmp/demo     # the demo model: 18.4 minutes on a 2-vCPU Zen 4
    python benchmarks/train_tiny_model.py --size draft --steps 3000 --out /tmp/draft

The tasks are those of ``benchmarks/tiny_tasks.py``: ``anna bench``'s passcode archive with the
passcode at any depth, copying a passage, copying it with one word replaced, and two-number sums. Only
the answer tokens (and the end-of-turn token after them) are scored, so every step's gradient is
about retrieving and copying, not about the random filler.

The tokenizer is a byte-level BPE trained the same way as the random demo model's, on text of the
same tasks (digits split one per token, so every passcode is spelled with the same ten tokens). The
model is a Qwen3 (q/k norms, grouped KV heads, tied embeddings) trained with transformers' own
implementation, so the weights load in transformers and in Anna alike.

Two phases, because a model this small learns the lookup only once it can copy:
1. Short passages to copy (and some to edit) until their loss falls below ``--copy-loss``: the
   induction heads form here (attention is started "mimetic" to make that quicker; see
   ``mimetic_init``). This took 608 steps in the shipped run; the phase ends at half the steps at most.
2. All tasks. Archives start at 2-4 lines, where a batch holds many answers, and double each time
   the retrieval loss falls below ``--retrieval-loss``, up to ``--max-lines`` (about 2,700 tokens).
   Passages grow with the steps. The shipped run learned the lookup around step 2,200 and reached
   128 lines at step 2,429; with ``--steps 3200`` (22.5 minutes) it reached them at 2,053 and, with
   three times as many steps at that length, retrieves to 4K tokens instead of 3K.

Only the answer positions' logits are computed, and short batches use eager attention (see
``EAGER_ATTENTION_UP_TO``): together a quarter off a step of short copies. With that and 2,800
steps instead of 3,600 the run takes 18.4 minutes instead of 27.

Runs are repeatable on one machine given ``--seed`` and the thread count (float sums differ across
instruction sets). The weights are written as bf16 safetensors with their SHA-256 in ``README.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_tasks  # noqa: E402
from anna.weights.demo_model import CORPUS, save_tokenizer, train_bpe  # noqa: E402

SIZES = {
    # hidden, layers, heads, kv heads, head dim, intermediate
    "demo": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=768),
    "draft": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  intermediate_size=384),
}
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
# batches up to this width use transformers' eager attention, longer ones its SDPA kernel: on CPU the
# eager matmuls are 10-20% faster per step for short sequences, SDPA 2x faster at 2,900 tokens
EAGER_ATTENTION_UP_TO = 512


def chat_prefix(prompt: str) -> str:
    """The demo chat template rendered for one user turn, up to the assistant's answer."""
    return f"{SYSTEM}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def train_tokenizer(seed: int):
    rng = random.Random(seed)
    texts = list(CORPUS)
    for _ in range(300):
        for chat in (tiny_tasks.retrieval(rng, 6), tiny_tasks.copy(rng, 40), tiny_tasks.edit(rng, 20),
                     tiny_tasks.arithmetic(rng)):
            texts.append(chat_prefix(chat.prompt) + chat.answer + "<|im_end|>\n")
    return train_bpe(texts, individual_digits=True)


class Batches:
    """Seeded batches of one task each, padded to their longest sequence, about ``tokens`` tokens each."""

    def __init__(self, tok, seed: int, tokens: int, max_lines: int, max_words: int) -> None:
        self.tok, self.rng, self.tokens = tok, random.Random(seed), tokens
        self.max_lines, self.max_words = max_lines, max_words
        self.lines = 4  # the longest archive of the moment: doubled each time retrieval is learned at it
        self.eot = tok.token_to_id("<|im_end|>")
        self.pad = tok.token_to_id("<|endoftext|>")

    def longer_archives(self) -> bool:
        if self.lines >= self.max_lines:
            return False
        self.lines = min(self.max_lines, self.lines * 2)
        return True

    def encode(self, chat: tiny_tasks.Chat) -> tuple[list[int], list[int]]:
        prompt = self.tok.encode(chat_prefix(chat.prompt)).ids
        answer = self.tok.encode(chat.answer).ids + [self.eot]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    def sample(self, progress: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of the first phase (``progress`` None: short copies, until copying is learned),
        or of the second at ``progress`` (0..1) through it."""
        rng = self.rng
        if progress is None:
            self.task = task = rng.choices(("copy", "edit"), weights=(0.8, 0.2))[0]
            words = rng.randint(8, 40)
            make = lambda: getattr(tiny_tasks, task)(rng, words)  # noqa: E731
        else:
            # passages grow over the first 60% of the phase, then every length up to the longest is seen
            grow = min(1.0, 0.1 + progress / 0.6)
            self.task = task = rng.choices(tiny_tasks.TASKS, weights=(0.6, 0.15, 0.15, 0.1))[0]
            if task == "retrieval":
                lines = rng.randint(2, self.lines)
                make = lambda: tiny_tasks.retrieval(rng, lines)  # noqa: E731
            elif task in ("copy", "edit"):
                words = rng.randint(8, max(40, int(self.max_words * grow)))
                make = lambda: getattr(tiny_tasks, task)(rng, words)  # noqa: E731
            else:
                make = lambda: tiny_tasks.arithmetic(rng)  # noqa: E731
        seqs = [self.encode(make())]
        while len(seqs) * max(len(s) for s, _ in seqs) < self.tokens:
            seqs.append(self.encode(make()))
        width = max(len(s) for s, _ in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, (s, mask) in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            labels[i, :len(s)] = torch.tensor([t if m else -100 for t, m in zip(s, mask)])
        return ids, labels


@torch.no_grad()
def mimetic_init(model, alpha: float) -> None:
    """Start each query head near its key head and each head's output near its value's transpose.

    Attention then begins by attending to tokens like the current one and copying what it reads
    (the "mimetic" initialization of Trockman and Kolter, 2023), which is where the induction heads
    that retrieval and copying need grow from. With random starts those heads form several times
    later, past what fits in a CPU budget of minutes."""
    cfg = model.config
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for layer in model.model.layers:
        attn = layer.self_attn
        wq = attn.q_proj.weight.view(heads, hd, -1)
        wk = attn.k_proj.weight.view(kv_heads, hd, -1)
        wv = attn.v_proj.weight.view(kv_heads, hd, -1)
        wo = attn.o_proj.weight.view(-1, heads, hd)
        for h in range(heads):
            g = h * kv_heads // heads
            wq[h].mul_(1 - alpha).add_(alpha * wk[g])
            wo[:, h, :].mul_(1 - alpha).add_(alpha * wv[g].t())


def answer_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the answer tokens, with logits computed at those positions only (the full
    [tokens, vocabulary] logits are most of a step's output layer and all but a few are not scored)."""
    model.config._attn_implementation = "eager" if ids.shape[1] <= EAGER_ATTENTION_UP_TO else "sdpa"
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    scored = target != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[scored]).float(), target[scored])


def write_model(model, tok, out: Path, args: argparse.Namespace) -> str:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out, model.config.max_position_embeddings)
    config = model.config.to_dict()
    keep = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "hidden_act", "attention_bias", "bos_token_id",
            "eos_token_id")
    config = {k: config[k] for k in keep if k in config}
    config["architectures"] = [type(model).__name__]  # set by save_pretrained, which is not used here
    config["rope_theta"] = args.rope_theta
    config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [config["eos_token_id"], config["bos_token_id"]]}) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="demo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=2800)
    ap.add_argument("--tokens-per-step", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-lines", type=int, default=128, help="longest archive trained on (about 20 tokens a line)")
    ap.add_argument("--max-words", type=int, default=160, help="longest passage to copy")
    ap.add_argument("--mimetic", type=float, default=0.8, help="weight of the mimetic attention initialization")
    ap.add_argument("--copy-loss", type=float, default=1.0,
                    help="the first phase (short copies and edits) ends when the copy loss falls below this, "
                         "or at 50%% of the steps")
    ap.add_argument("--retrieval-loss", type=float, default=0.2,
                    help="archives double in length each time the retrieval loss falls below this")
    ap.add_argument("--max-positions", type=int, default=4096,
                    help="max_position_embeddings written to config.json: the context it is served with by default")
    ap.add_argument("--rope-theta", type=float, default=1_000_000.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="autocast dtype of the matmuls (weights and optimizer stay fp32); float32 on CPUs "
                         "without AVX512-BF16 or AMX, where bf16 is emulated")
    args = ap.parse_args()

    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok = train_tokenizer(args.seed)
    eot, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = Qwen3Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=args.max_positions,
                         rms_norm_eps=1e-6, rope_theta=args.rope_theta, tie_word_embeddings=True,
                         bos_token_id=endoftext, eos_token_id=eot, attention_bias=False, attn_implementation="sdpa",
                         **SIZES[args.size])
    config.rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
    model = Qwen3ForCausalLM(config)
    mimetic_init(model, args.mimetic)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.size}: {params / 1e6:.2f} M parameters, vocabulary {config.vocab_size}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    decay = int(args.steps * 0.7)  # a short warm-up, the full rate until 70%, then a cosine down to a tenth

    def rate(s: int) -> float:
        tail = min(1.0, max(0, s - decay) / (args.steps - decay))
        return min(1.0, (s + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    batches = Batches(tok, args.seed + 1, args.tokens_per_step, args.max_lines, args.max_words)
    model.train()
    t0, ema = time.perf_counter(), {}
    bar = tqdm(range(args.steps), desc="train", mininterval=5)
    switch = None  # the step where copying was learned and the second phase began
    grown = 0  # the step where the archives last grew
    for step in bar:
        if switch is None and (ema.get("copy", 9.0) < args.copy_loss or step >= args.steps * 0.5):
            switch = step
            print(f"step {step}: copy loss {ema.get('copy', 9.0):.3f}, the first phase ends; all tasks from here",
                  flush=True)
        if switch is not None and ema.get("retrieval", 9.0) < args.retrieval_loss and step - grown >= 50:
            # a short archive gives a dense signal (many answers per batch): the lookup is learned
            # there, and the archives double each time it is
            if batches.longer_archives():
                grown = step
                print(f"step {step}: retrieval loss {ema['retrieval']:.3f}, archives up to {batches.lines} lines",
                      flush=True)
        ids, labels = batches.sample(None if switch is None else (step - switch) / (args.steps - switch))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            loss = answer_loss(model, ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        task = batches.task  # a moving average per task: their losses differ by orders of magnitude
        ema[task] = loss.item() if task not in ema else 0.9 * ema[task] + 0.1 * loss.item()
        bar.set_postfix(width=ids.shape[1], **{k: f"{v:.3f}" for k, v in sorted(ema.items())})
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step} " + " ".join(f"{k} {v:.4f}" for k, v in sorted(ema.items())) +
                  f" {time.perf_counter() - t0:.0f} s", flush=True)
    digest = write_model(model, tok, args.out, args)
    (args.out / "README.md").write_text(
        f"Anna's {args.size} model: a Qwen3 of {params / 1e6:.2f} M parameters trained on synthetic tasks "
        f"(benchmarks/tiny_tasks.py).\n\n"
        f"    python benchmarks/train_tiny_model.py --size {args.size} --seed {args.seed} --steps {args.steps} "
        f"--tokens-per-step {args.tokens_per_step} --max-lines {args.max_lines} --threads {args.threads} "
        f"--out DIR\n\n"
        f"model.safetensors sha256: {digest}\n")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s; model.safetensors sha256 {digest}")


if __name__ == "__main__":
    main()
