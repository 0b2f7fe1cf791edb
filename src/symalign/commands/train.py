"""``symalign train``: train a built-in Transformer on an offline dataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from symalign.commands import checks



def register(app: typer.Typer) -> None:
    app.command("train")(train_command)


def train_command(
    family: str = typer.Option("vit", help="Model family: vit, gpt or encoder."),
    data: str = typer.Option("digits", help="Dataset: digits, fashion-mnist, shakespeare, bible, wordnet, fortunes, "
                             "synthetic, or a public one (mnist, cifar10, cifar100, imagefolder, enwik8, wikitext103, "
                             "lm1b, ag_news, imdb, dbpedia; see docs/paper-setting.md)."),
    root: Optional[Path] = typer.Option(None, help="Folder of a public dataset (default $SYMALIGN_DATA/<name>)."),
    download: bool = typer.Option(False, help="Download a missing public dataset (where a download URL exists)."),
    tokenizer: Optional[Path] = typer.Option(None,
                                             help="Hugging Face tokenizer folder for text data (default: bytes)."),
    image_size: Optional[int] = typer.Option(None, "--image-size", help="Resize image-folder images to this size."),
    pe: str = typer.Option("rope", help="Positional encoding: none, sinusoidal, learned, rope, alibi."),
    d_model: int = typer.Option(64, "--d-model", help="Residual width D."),
    layers: int = typer.Option(2, help="Number of Transformer blocks."),
    heads: int = typer.Option(4, help="Attention heads (must divide --d-model)."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="K/V heads for grouped-query attention."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Per-head width (default --d-model / --heads)."),
    d_ff: Optional[int] = typer.Option(None, "--d-ff", help="MLP hidden width (default 4 D)."),
    norm: str = typer.Option("layernorm", help="layernorm or rmsnorm."),
    activation: str = typer.Option("gelu", help="gelu or relu."),
    pooling: str = typer.Option("cls", help="Classifier pooling: cls or mean."),
    patch_size: Optional[int] = typer.Option(None, "--patch-size", help="ViT patch size (default: 7, 4 or 2)."),
    rope_pairing: str = typer.Option("half", "--rope-pairing", help="RoPE planes: half or interleaved."),
    rotary_fraction: float = typer.Option(1.0, "--rotary-fraction", help="Fraction of each head rotated by RoPE."),
    context: int = typer.Option(128, help="LM context length (tokens)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Bytes per text-classification example."),
    subset: Optional[int] = typer.Option(None, help="Use only the first N training examples (LM: bytes)."),
    steps: int = typer.Option(500, help="Optimisation steps."),
    batch_size: int = typer.Option(64, "--batch-size", help="Batch size."),
    lr: float = typer.Option(1e-3, help="Peak learning rate."),
    warmup: Optional[int] = typer.Option(None, help="Warm-up steps (default min(100, steps/10))."),
    weight_decay: float = typer.Option(0.1, "--weight-decay", help="AdamW weight decay on matrices."),
    grad_clip: float = typer.Option(1.0, "--grad-clip", help="Clip the global gradient norm (0: off)."),
    seed: int = typer.Option(0, help="Seed for initialisation, data order and dropout."),
    out: Path = typer.Option(Path("runs/train"), "-o", "--out", help="Run directory (checkpoints go here)."),
    resume: bool = typer.Option(False, help="Continue from the latest checkpoint in --out."),
    threads: Optional[int] = checks.threads_option(),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    eval_every: int = typer.Option(200, "--eval-every", help="Evaluate and checkpoint every K steps."),
    eval_items: Optional[int] = typer.Option(None, "--eval-items", help="Cap on evaluation examples/windows."),
    as_json: bool = typer.Option(False, "--json", help="Print the final metadata as JSON."),
    quiet: bool = typer.Option(False, help="No progress output."),
) -> None:
    """Train a built-in Transformer (seeded, deterministic, resumable) and checkpoint it under --out."""
    from symalign.train import TrainConfig, train

    from symalign.checkpoint import has_checkpoint
    from symalign.commands import interrupt

    _check_arguments(data, threads, out, rotary_fraction, pe)
    threads = checks.use_threads(threads)
    interrupt.keep_run(out, add=("--resume",), resumable=lambda: has_checkpoint(out))
    model = dict(family=family, pe=pe, d_model=d_model, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                 head_dim=head_dim,
                 d_ff=d_ff, norm=norm, activation=activation, pooling=pooling, rope_pairing=rope_pairing,
                 rotary_fraction=rotary_fraction)
    if patch_size is not None:
        model["patch_size"] = patch_size
    _check_model(model, patch_size)
    data_options = _data_options(subset, seq_len, root, download, tokenizer, image_size)
    tc = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, weight_decay=weight_decay,
                     grad_clip=grad_clip, eval_every=eval_every, eval_items=eval_items, context=context, seed=seed)
    meta = train(model, data, tc, out, data_options=data_options, resume=resume, device=device, threads=threads,
                 progress=not quiet)  # progress goes to stderr; --json output to stdout
    _print_result(meta, as_json)


def _check_arguments(data: str, threads: Optional[int], out: Path, rotary_fraction: float, pe: str) -> None:
    """The dataset name, the thread count, the run folder and ``--rotary-fraction`` (RoPE only) checked before
    anything heavy (one-line errors)."""
    from symalign.data import canonical_name

    canonical_name(data)  # unknown dataset -> one-line error before anything heavy
    checks.threads(threads)
    checks.output_dir(out)
    if rotary_fraction != 1.0 and pe != "rope":
        from symalign.errors import ConfigError

        raise ConfigError(f"--rotary-fraction applies to --pe rope only (got --pe {pe}); drop it or use --pe rope")


def _check_model(model: dict, patch_size: Optional[int]) -> None:
    """Validate the data-independent model fields now (one-line errors before loading any data): a
    :class:`ModelConfig` built with placeholder image size and context."""
    from symalign.models.config import ModelConfig

    ModelConfig(**{**model, "image_size": patch_size or 7, "patch_size": patch_size or 7, "max_len": 4096})


def _data_options(subset: Optional[int], seq_len: Optional[int], root: Optional[Path], download: bool,
                  tokenizer: Optional[Path], image_size: Optional[int]) -> dict:
    """The dataset loader's options: only those given on the command line (paths as strings)."""
    data_options: dict = {}
    if subset is not None:
        data_options["subset"] = subset
    if seq_len is not None:
        data_options["seq_len"] = seq_len
    if root is not None:
        data_options["root"] = str(root)
    if download:
        data_options["download"] = True
    if tokenizer is not None:
        data_options["tokenizer"] = str(tokenizer)
    if image_size is not None:
        data_options["image_size"] = image_size
    return data_options


def _print_result(meta: dict, as_json: bool) -> None:
    """The final metadata as JSON (``--json``), else one line: the checkpoint, its step, its val/test metrics."""
    if as_json:
        typer.echo(json.dumps({k: meta[k] for k in ("model", "data", "train", "seed", "step", "metrics",
                                                    "checkpoint")}, indent=2))
    else:
        m = meta["metrics"]
        typer.echo(f"saved {meta['checkpoint']} (step {meta['step']}): "
                   + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k.startswith(("val_", "test_"))))
