"""Two tiny Hugging Face GPT-2 checkpoints trained from different seeds, with a BPE tokenizer trained offline.

    python examples/hf_gpt2_pair.py OUT_DIR [--steps 600] [--seeds 0 1] [--vocab 1024] [--threads N]

Writes ``OUT_DIR/tokenizer`` (byte-level BPE trained with the ``tokenizers``
library on the training split of the built-in Shakespeare corpus) and one
``save_pretrained`` checkpoint per seed, ``OUT_DIR/gpt2-s{seed}``, each with the
tokenizer files beside the weights -- ready for ``symalign align``,
``symalign interpolate --data shakespeare`` (evaluated on the test split) and
``symalign merge``. Training: AdamW, cosine schedule, random windows of
``--context`` tokens of the token stream; only the initialisation and batch
order differ between seeds. Threads: ``--threads``, else ``$SYMALIGN_THREADS``, else 1 (as every
``symalign`` command); the count torch ran with is recorded in ``OUT_DIR/gpt2-pair.json`` with the
arguments and provenance.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch


def train_text() -> str:
    from symalign.data import text
    from symalign.data.base import split_stream

    raw = np.frombuffer(text.load_shakespeare_text().encode("utf-8"), dtype=np.uint8)
    return split_stream(raw, 0)[0].tobytes().decode("utf-8", errors="replace")


def bpe_tokenizer(text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.splitlines(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def train(seed: int, ids: torch.Tensor, tok, args) -> "torch.nn.Module":
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=args.width, n_layer=args.layers, n_head=args.heads, n_positions=args.context,
                     vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + seed)
    t0 = time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        off = torch.randint(0, len(ids) - args.context, (args.batch,), generator=g)
        x = ids[off.unsqueeze(1) + torch.arange(args.context)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"seed {seed} step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    import _threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    _threads.add_option(p)
    args = p.parse_args(argv)
    threads = _threads.use(p, args.threads)
    print(f"torch threads: {threads}", flush=True)
    text = train_text()
    tok = bpe_tokenizer(text, args.vocab)
    tok.save_pretrained(args.out / "tokenizer")
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    print(f"{len(text)} characters -> {len(ids)} tokens (vocabulary {len(tok)})", flush=True)
    for seed in args.seeds:
        model = train(seed, ids, tok, args)
        model.save_pretrained(args.out / f"gpt2-s{seed}")
        tok.save_pretrained(args.out / f"gpt2-s{seed}")
    _threads.record(args.out / "gpt2-pair.json", "examples/hf_gpt2_pair.py", args, threads,
                    checkpoints=[f"gpt2-s{seed}" for seed in args.seeds])


if __name__ == "__main__":
    main()
