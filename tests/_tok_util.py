"""Real tokenizers trained offline with the ``tokenizers`` library on text the tests write, and tiny HF models
saved with them (shared by the evaluation and merge tests)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

transformers = __import__("pytest").importorskip("transformers")
T = transformers
T.utils.logging.disable_progress_bar()
T.utils.logging.set_verbosity_error()

WORDS = ("the king queen speaks loud soft night day sword crown love hate river stone bright dark ever never "
         "whither thou art shall know wind fire summer winter rose thorn gold silver heart mind "
         "café naïve über").split()


def corpus(n_lines: int = 400, seed: int = 0) -> str:
    """Seeded pseudo-English (a few non-ASCII words, so byte counts differ from character counts)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(lines) + "\n"


def bpe(text: str, vocab: int = 300):
    """A byte-level BPE tokenizer (GPT-2 style) with ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.splitlines(), trainer)
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                     unk_token="<|endoftext|>")


def wordpiece(text: str, vocab: int = 200):
    """A BERT-style WordPiece tokenizer: ``[CLS] x [SEP]``, ``[MASK]``, ``[PAD]``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(text.splitlines(), trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=specials,
                                                                         show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                     sep_token="[SEP]", mask_token="[MASK]")


def unigram(text: str, vocab: int = 150):
    """A SentencePiece-style Unigram tokenizer (Metaspace) with ``</s>`` and ``<mask>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(text.splitlines(), trainers.UnigramTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "</s>", "<unk>", "<mask>"], unk_token="<unk>", show_progress=False))
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                     mask_token="<mask>")


TOKENIZERS = {"bpe": bpe, "wordpiece": wordpiece, "unigram": unigram}


def gpt2(path: Path, tok, seed: int = 0, n_positions: int = 64, **kw) -> Path:
    torch.manual_seed(seed)
    cfg = T.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=len(tok), n_positions=n_positions,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **kw)
    T.GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bert(path: Path, tok, seed: int = 0, head: str = "mlm", num_labels: int = 2) -> Path:
    torch.manual_seed(seed)
    cfg = T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       vocab_size=len(tok), max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                       num_labels=num_labels)
    cls = T.BertForMaskedLM if head == "mlm" else T.BertForSequenceClassification
    cls(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def vit(path: Path, seed: int = 0, num_labels: int = 3, channels: int = 3) -> Path:
    torch.manual_seed(seed)
    cfg = T.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                      image_size=8, patch_size=4, num_channels=channels, num_labels=num_labels)
    T.ViTForImageClassification(cfg).save_pretrained(path)
    T.ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.5] * channels,
                        image_std=[0.5] * channels).save_pretrained(path)
    return path


def image_folder(root: Path, classes=("cat", "dog", "fox"), per_class: int = 4, seed: int = 0) -> Path:
    """PNG images (10x12 RGB, class-dependent colour plus noise) in ``root/<class>/``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k, c in enumerate(classes):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = np.clip(rng.normal(60 * k + 40, 30, size=(10, 12, 3)), 0, 255).astype("uint8")
            Image.fromarray(arr).save(root / c / f"{i}.png")
    return root
