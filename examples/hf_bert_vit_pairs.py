"""Two tiny Hugging Face BERT masked LMs and two tiny ViTs trained from different seeds, offline.

    python examples/hf_bert_vit_pairs.py OUT_DIR [--only bert|vit] [--seeds 0 1] [--bert-steps 2000]
                                                [--vit-epochs 30] [--threads N]

BERT (``BertForMaskedLM``): a WordPiece tokenizer is trained with the
``tokenizers`` library on the training split of the built-in Shakespeare corpus
(BERT normaliser and pre-tokeniser, ``[CLS] x [SEP]`` template, ``[MASK]``) and
saved as ``OUT_DIR/wordpiece``; each seed's model is trained on random windows of
``--context - 2`` tokens of the token stream wrapped in ``[CLS] ... [SEP]``, with
BERT's masking (15 % of the non-special positions; of those 80 % ``[MASK]``,
10 % a random token, 10 % kept) drawn afresh each step, and saved with the
tokenizer files as ``OUT_DIR/bert-s{seed}`` -- ready for ``symalign interpolate
--data shakespeare`` (test split, fixed seeded masks).

ViT (``ViTForImageClassification``): scikit-learn's 8x8 digits (the built-in
``digits`` dataset, training split), one grey channel, 2x2 patches; a
``ViTImageProcessor`` (no resize, rescale to [0, 1], normalise with mean 0.5 and
std 0.5) is saved beside each model as ``OUT_DIR/vit-s{seed}``, and the training
images go through that processor exactly as ``symalign interpolate --data
digits`` feeds them.

Training: AdamW, warm-up then cosine schedule; only the initialisation, the masks
and the batch order differ between seeds. Threads: ``--threads``, else ``$SYMALIGN_THREADS``, else 1 (as
every ``symalign`` command); the count torch ran with is recorded in ``OUT_DIR/bert-pair.json`` and
``OUT_DIR/vit-pair.json`` with the arguments and provenance (:mod:`hf_bert_vit_results` copies it).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train_text() -> str:
    from symalign.data import text
    from symalign.data.base import split_stream

    raw = np.frombuffer(text.load_shakespeare_text().encode("utf-8"), dtype=np.uint8)
    return split_stream(raw, 0)[0].tobytes().decode("utf-8", errors="replace")


def wordpiece_tokenizer(text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(text.splitlines(), trainers.WordPieceTrainer(
        vocab_size=vocab, special_tokens=SPECIALS, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def bert_batch(ids: torch.Tensor, tok, args, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``[CLS] x [SEP]`` with BERT's 15 % masking (80 / 10 / 10); labels -100 off the masks."""
    body = args.context - 2
    off = torch.randint(0, len(ids) - body, (args.batch,), generator=g)
    x = ids[off.unsqueeze(1) + torch.arange(body)]
    x = torch.cat([torch.full((args.batch, 1), tok.cls_token_id), x, torch.full((args.batch, 1), tok.sep_token_id)], 1)
    pick = torch.rand(x.shape, generator=g) < 0.15
    pick[:, 0] = pick[:, -1] = False
    r = torch.rand(x.shape, generator=g)
    inputs = torch.where(pick & (r < 0.8), torch.full_like(x, tok.mask_token_id), x)
    inputs = torch.where(pick & (r >= 0.8) & (r < 0.9), torch.randint(0, len(tok), x.shape, generator=g), inputs)
    return inputs, torch.where(pick, x, torch.full_like(x, -100))


def lr_at(step: int, steps: int, lr: float) -> float:
    return lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))


def train_bert(seed: int, ids: torch.Tensor, tok, args):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=args.width, num_hidden_layers=args.layers,
                     num_attention_heads=args.heads, intermediate_size=4 * args.width,
                     max_position_embeddings=args.context, pad_token_id=tok.pad_token_id)
    model = BertForMaskedLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + seed)
    t0 = time.time()
    for step in range(args.bert_steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.bert_steps, args.lr)
        x, y = bert_batch(ids, tok, args, g)
        loss = model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.bert_steps - 1:
            print(f"bert seed {seed} step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    return model.eval()


def digits_pixels(processor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``digits`` split through ``processor`` exactly as ``symalign interpolate --data digits`` feeds it."""
    from PIL import Image

    from symalign.data import load_dataset
    from symalign.evaluate.build import _process

    x, y = load_dataset("digits").split(split)
    arr = (x.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    images = [Image.fromarray(a[0]) for a in arr]
    cfg = argparse.Namespace(num_channels=1)
    return _process(processor, images, cfg, torch.float32), y.long()


def train_vit(seed: int, processor, args):
    from transformers import ViTConfig, ViTForImageClassification

    pixels, labels = digits_pixels(processor, "train")
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=args.width,
                    num_hidden_layers=args.layers, num_attention_heads=args.heads, intermediate_size=4 * args.width,
                    num_labels=10)
    model = ViTForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1000 + seed)
    per_epoch = math.ceil(len(labels) / args.batch)
    steps = args.vit_epochs * per_epoch
    t0, step = time.time(), 0
    for epoch in range(args.vit_epochs):
        order = torch.randperm(len(labels), generator=g)
        for b in range(per_epoch):
            idx = order[b * args.batch:(b + 1) * args.batch]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, args.lr)
            loss = model(pixel_values=pixels[idx], labels=labels[idx]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        if epoch % 10 == 0 or epoch == args.vit_epochs - 1:
            print(f"vit seed {seed} epoch {epoch} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    import _threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", choices=["bert", "vit"], default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--bert-steps", type=int, default=2000)
    p.add_argument("--vit-epochs", type=int, default=30)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    _threads.add_option(p)
    args = p.parse_args(argv)
    threads = _threads.use(p, args.threads)
    print(f"torch threads: {threads}", flush=True)
    if args.only in (None, "bert"):
        text = train_text()
        tok = wordpiece_tokenizer(text, args.vocab)
        tok.save_pretrained(args.out / "wordpiece")
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        print(f"{len(text)} characters -> {len(ids)} WordPiece tokens (vocabulary {len(tok)})", flush=True)
        for seed in args.seeds:
            model = train_bert(seed, ids, tok, args)
            model.save_pretrained(args.out / f"bert-s{seed}")
            tok.save_pretrained(args.out / f"bert-s{seed}")
        _threads.record(args.out / "bert-pair.json", "examples/hf_bert_vit_pairs.py", args, threads,
                        checkpoints=[f"bert-s{seed}" for seed in args.seeds])
    if args.only in (None, "vit"):
        from transformers import ViTImageProcessor

        processor = ViTImageProcessor(do_resize=False, size={"height": 8, "width": 8}, do_rescale=True,
                                      rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5], image_std=[0.5])
        for seed in args.seeds:
            model = train_vit(seed, processor, args)
            model.save_pretrained(args.out / f"vit-s{seed}")
            processor.save_pretrained(args.out / f"vit-s{seed}")
        _threads.record(args.out / "vit-pair.json", "examples/hf_bert_vit_pairs.py", args, threads,
                        checkpoints=[f"vit-s{seed}" for seed in args.seeds])


if __name__ == "__main__":
    main()
