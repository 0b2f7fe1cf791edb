"""Failing loudly and right (issue 33): interrupts exit 130 with one line saying what was kept; unwritable
outputs, bad weights, a checkpoint listed twice, a B aligned to another A, a B without tokenizer files, a
`symalign train` checkpoint and a mistyped --data path are refused in one line (exit 2) before any work,
with nothing written; --threads is taken by every command that runs torch."""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _cli_util import run_symalign  # noqa: E402
from _tok_util import TOKENIZERS, corpus, gpt2  # noqa: E402
from hf_tiny import inputs, make_model, output, rel  # noqa: E402

from symalign.families import get_adapter  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vit-digits-rope.toml"


def _vit(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4, num_channels=1, num_labels=10)
    transformers.ViTForImageClassification(cfg).save_pretrained(path)
    return path


@pytest.fixture
def pair(tmp_path):
    return _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)


@pytest.fixture(scope="module")
def tok():
    return TOKENIZERS["bpe"](corpus(300, seed=1), vocab=64 + 256)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _refused(code: int, err: str, *words: str) -> None:
    line = _one_line(err)
    assert code == 2 and line.startswith("symalign: error:") and "Traceback" not in err, err
    for w in words:
        assert w in line, (w, err)


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its inode and mtime: any write shows."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _no_work(monkeypatch, *targets: str) -> None:
    """Make each ``module:attr`` fail the test if called: the refusal must come first."""
    import importlib

    for target in targets:
        mod, attr = target.split(":")

        def boom(*a, _t=target, **k):
            raise AssertionError(f"{_t} ran before the refusal")

        monkeypatch.setattr(importlib.import_module(mod), attr, boom)


# ----------------------------------------------------------------------------- interrupts


def _interrupt(monkeypatch, module: str, attr: str) -> None:
    """Ctrl-C arriving inside ``module.attr`` (the work), as KeyboardInterrupt."""
    import importlib

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), attr, ctrl_c)


def test_interrupted_align_exits_130_and_keeps_the_previous_out(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    out = tmp_path / "OUT"
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out)
    assert code == 0, err
    before = _listing(tmp_path)
    _interrupt(monkeypatch, "symalign.io.folder", "write_tensors")  # while the new OUT is staged
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, "--force")
    assert code == 130, err
    assert _one_line(err) == f"symalign: interrupted; the previous {out} is intact"
    assert _listing(tmp_path) == before  # OUT untouched, no temporary folder left


def test_interrupted_align_into_a_new_folder_writes_nothing(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    _interrupt(monkeypatch, "symalign.io.folder", "write_tensors")
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", tmp_path / "OUT")
    assert code == 130 and _one_line(err) == f"symalign: interrupted; nothing was written to {tmp_path / 'OUT'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B"]


def test_interrupted_merge_and_interpolate_exit_130(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    _interrupt(monkeypatch, "symalign.pipeline", "align_loaded")  # during the first alignment
    code, _, err = run_symalign(monkeypatch, capsys, "merge", a, b, "-o", tmp_path / "M")
    assert code == 130 and _one_line(err) == f"symalign: interrupted; nothing was written to {tmp_path / 'M'}"
    _interrupt(monkeypatch, "symalign.jobs.interpolate", "curve")  # while the points are evaluated
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "digits", "--points", "2",
                                "--eval-items", "8", "-o", tmp_path / "I", "--no-stream")
    assert code == 130 and _one_line(err) == f"symalign: interrupted; nothing was written to {tmp_path / 'I'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A", "B"]


def test_interrupted_experiment_names_the_command_that_continues_it(tmp_path, monkeypatch, capsys):
    import symalign.experiments as experiments

    runs = tmp_path / "runs"
    calls = []

    def interrupted(cfg, out, **kw):
        (Path(out) / cfg.name).mkdir(parents=True)  # a run folder with finished work in it
        calls.append(kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "run_experiment", interrupted)
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", CONFIG, "--out", runs, "--fresh", "--quiet")
    assert code == 130, err
    line = _one_line(err)
    assert line.startswith(f"symalign: interrupted; the run folder {runs / 'vit-digits-rope'} keeps the finished "
                           "work; continue with: symalign experiment "), line
    command = line.split("continue with: ", 1)[1]
    assert shlex.split(command) == ["symalign", "experiment", str(CONFIG), "--out", str(runs), "--quiet"]
    # the command is real: it parses, and it resumes (no --fresh) into the same run folder
    monkeypatch.setattr(experiments, "run_experiment", lambda cfg, out, **kw: calls.append({**kw, "out": out}) or [])
    code, _, err = run_symalign(monkeypatch, capsys, *shlex.split(command)[1:])
    assert code == 0, err
    assert calls[0]["fresh"] is True and calls[1]["fresh"] is False and calls[1]["out"] == runs


@pytest.mark.slow
def _as_from_a_shell() -> None:
    """The child's signal state as a shell gives it: no signal blocked, SIGINT at its default. A mask or an ignored
    SIGINT left in the test process by an earlier test (a library's threads) would otherwise be inherited through
    fork and exec, and the SIGINT below never delivered."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_exits_130_with_the_resume_command(tmp_path):
    """A real SIGINT on the console command (a `symalign train` that has saved a checkpoint)."""
    out = tmp_path / "tr"
    import symalign

    src = str(Path(symalign.__file__).resolve().parents[1])  # the symalign under test
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    argv = ["train", "--steps", "100000", "--eval-every", "2", "--eval-items", "8", "--d-model", "8", "--layers",
            "1", "--heads", "2", "--quiet", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "symalign.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_as_from_a_shell)
    t0 = time.time()
    while not (out / "latest").exists() and proc.poll() is None and time.time() - t0 < 120:
        time.sleep(0.1)
    assert (out / "latest").exists(), proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last == (f"symalign: interrupted; the run folder {out} keeps the finished work; continue with: "
                    + shlex.join(["symalign", *argv, "--resume"])), err


# ----------------------------------------------------------------------------- unwritable outputs


@pytest.fixture
def readonly(tmp_path, monkeypatch):
    """A folder RO where nothing can be created, for root too: ``os.mkdir`` and creating ``os.open`` of a
    path inside it fail with EACCES, as they would on a read-only mount (root ignores mode bits)."""
    ro = tmp_path / "RO"
    ro.mkdir()
    real_mkdir, real_open = os.mkdir, os.open

    def inside(path) -> bool:
        return Path(os.fsdecode(path)).resolve().parent == ro.resolve() or ro.resolve() in Path(
            os.fsdecode(path)).resolve().parents

    def mkdir(path, *a, **k):
        if inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_mkdir(path, *a, **k)

    def open_(path, flags, *a, **k):
        if flags & os.O_CREAT and inside(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    return ro


def test_readonly_output_refused_before_any_work(pair, tmp_path, readonly, monkeypatch, capsys):
    a, b = pair
    before = _listing(tmp_path)
    cases = [("align", [a, b, "-o", readonly / "out"]),
             ("merge", [a, b, "-o", readonly / "out"]),
             ("interpolate", [a, b, "--data", "digits", "--points", "2", "--eval-items", "8", "-o", readonly / "o"]),
             ("align", [a, b, "-o", readonly / "deeper" / "out"])]
    _no_work(monkeypatch, "symalign.checkpoint.hf:load_checkpoint", "symalign.jobs.interpolate:open_pair",
             "symalign.jobs.interpolate:curve")
    for command, args in cases:
        code, _, err = run_symalign(monkeypatch, capsys, command, *args)
        _refused(code, err, "cannot write in", str(readonly), "Permission denied")
    assert _listing(tmp_path) == before


def test_output_under_a_regular_file_refused(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    afile = tmp_path / "afile"
    afile.write_text("user data\n")
    _no_work(monkeypatch, "symalign.checkpoint.hf:load_checkpoint", "symalign.jobs.interpolate:open_pair")
    for command, extra in (("align", []), ("merge", []), ("interpolate", ["--data", "digits"])):
        code, _, err = run_symalign(monkeypatch, capsys, command, a, b, *extra, "-o", afile / "out")
        _refused(code, err, f"{afile} is a file, not a folder")
    assert afile.read_text() == "user data\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through mode bits; the fixture above covers root")
def test_readonly_folder_by_mode_bits(pair, tmp_path, monkeypatch, capsys):  # pragma: no cover - not root
    a, b = pair
    ro = tmp_path / "RO"
    ro.mkdir(mode=0o555)
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", ro / "out")
    _refused(code, err, "cannot write in")


# ----------------------------------------------------------------------------- merge: weights, duplicates, progress


def _planted_gpt2(tmp_path, tok):
    a = make_model("gpt2", dtype=torch.float32, seed=0, vocab_size=len(tok))
    spec = get_adapter(a).spec(a)
    b = make_model("gpt2", dtype=torch.float32, seed=0, vocab_size=len(tok))
    b.load_state_dict(apply(spec, sample(spec, 7), a.state_dict()))
    for m, name in ((a, "A"), (b, "B")):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    return a, tmp_path / "A", tmp_path / "B"


@pytest.mark.parametrize("weights, words", [
    ("inf,1", ["finite and positive", "inf"]),
    ("nan,1", ["finite and positive", "nan"]),
    ("0,1", ["finite and positive", "left out"]),
    ("-1,2", ["finite and positive"]),
    ("1e400,1", ["finite and positive", "inf"]),  # parses to inf
])
def test_bad_weights_refused_before_any_work(weights, words, pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    before = _listing(tmp_path)
    _no_work(monkeypatch, "symalign.pipeline:align_loaded", "symalign.checkpoint.hf:load_checkpoint")
    code, _, err = run_symalign(monkeypatch, capsys, "merge", a, b, "-o", tmp_path / "M", "--weights", weights)
    _refused(code, err, "--weights", *words)
    assert _listing(tmp_path) == before


def test_huge_equal_weights_are_a_half_each(tmp_path, monkeypatch, capsys, tok):
    """1e308 + 1e308 overflows; the weights are divided by their largest first: 0.5, 0.5, a real model."""
    a, da, db = _planted_gpt2(tmp_path, tok)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / "M", "--weights",
                                  "1e308,1e308", "--json")
    assert code == 0, err
    assert json.loads(out)["weights"] == [0.5, 0.5]
    merged = type(a).from_pretrained(str(tmp_path / "M"), attn_implementation="eager").eval()
    x = inputs(a)
    assert rel(output(merged, x), output(a, x)) <= 1e-5  # merge(A, g.A) = A, not an all-zero model


def test_merge_refuses_a_checkpoint_listed_twice(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    _no_work(monkeypatch, "symalign.pipeline:align_loaded", "symalign.checkpoint.hf:load_checkpoint")
    code, _, err = run_symalign(monkeypatch, capsys, "merge", a, b, tmp_path / "x" / ".." / "A", "-o", tmp_path / "M")
    _refused(code, err, "listed twice", "checkpoints 1 and 3", "--weights")
    assert not (tmp_path / "M").exists()


@pytest.mark.slow
def test_merge_shows_its_steps_on_stderr(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    code, out, err = run_symalign(monkeypatch, capsys, "merge", a, b, "-o", tmp_path / "M")
    assert code == 0, err
    assert "merge: done" in err and "4/4" in err, err  # read, align B, average and write, check
    code, out, err = run_symalign(monkeypatch, capsys, "merge", a, b, "-o", tmp_path / "M2", "--no-progress")
    assert code == 0 and err.strip() == "", err


def test_merge_help_says_what_force_does(monkeypatch, capsys):
    code, out, _ = run_symalign(monkeypatch, capsys, "merge", "--help")
    flat = " ".join(out.replace("│", " ").split())
    assert "previous symalign output" in flat and "never replaced" in flat
    assert "Replace OUT if it exists" not in flat


def test_mistyped_data_path_is_named_without_exception_classes(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shakespeare.txt").write_text("To be or not to be.\n")
    _no_work(monkeypatch, "symalign.jobs.interpolate:open_pair", "symalign.checkpoint.hf:load_checkpoint")
    for command, option in (("interpolate", "--data"), ("merge", "--eval")):
        code, _, err = run_symalign(monkeypatch, capsys, command, a, b, option, tmp_path / "data" / "shakspeare.txt",
                                    "-o", tmp_path / "o")
        _refused(code, err, "no such file or folder", "did you mean", "shakespeare.txt")
        assert "Error)" not in err
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", tmp_path / "nodir" / "x.txt",
                                "-o", tmp_path / "o")
    _refused(code, err, "no such file or folder", f"{tmp_path / 'nodir'} does not exist")


# ----------------------------------------------------------------------------- interpolate: OUT and the reference


def test_interpolate_out_is_replaced_only_with_force(pair, tmp_path, monkeypatch, capsys):
    a, b = pair
    run = ["interpolate", a, b, "--data", "digits", "--points", "2", "--eval-items", "16", "--no-progress"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text("my own results\n")
    (mine / "notes.txt").write_text("keep me\n")
    for extra in ([], ["--force"]):  # a folder interpolate did not write: never replaced
        code, _, err = run_symalign(monkeypatch, capsys, *run, "-o", mine, *extra)
        _refused(code, err, "did not write")
    assert (mine / "results.json").read_text() == "my own results\n"
    out = tmp_path / "o"
    code, _, err = run_symalign(monkeypatch, capsys, *run, "-o", out)
    assert code == 0, err
    first = (out / "results.json").read_text()
    assert json.loads((out / "symalign.json").read_text())["command"] == "interpolate"
    code, _, err = run_symalign(monkeypatch, capsys, *run, "-o", out)
    _refused(code, err, "already holds interpolate results", "--force")
    assert (out / "results.json").read_text() == first
    code, _, err = run_symalign(monkeypatch, capsys, *run, "-o", out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "results.json", "symalign.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    code, _, err = run_symalign(monkeypatch, capsys, *run, "-o", tmp_path / "empty")
    assert code == 0, err


def test_interpolate_against_another_reference_is_refused(tmp_path, monkeypatch, capsys):
    a1, a2, b = _vit(tmp_path / "A1", 0), _vit(tmp_path / "A2", 2), _vit(tmp_path / "B", 1)
    code, _, err = run_symalign(monkeypatch, capsys, "align", a1, b, "-o", tmp_path / "B1")
    assert code == 0, err
    run = ["--data", "digits", "--points", "2", "--eval-items", "16", "--no-progress"]
    with monkeypatch.context() as m:
        _no_work(m, "symalign.jobs.interpolate:open_pair")
        code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a2, tmp_path / "B1", *run, "-o",
                                    tmp_path / "o")
    _refused(code, err, f"{tmp_path / 'B1'} was aligned to {a1.resolve()}", f"not to {a2}", "--force")
    assert not (tmp_path / "o").exists()
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a2, tmp_path / "B1", *run, "-o",
                                  tmp_path / "o", "--force")
    assert code == 0 and "symalign: warning:" in err and "was aligned to" in err, err
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a1, tmp_path / "B1", *run, "-o",
                                  tmp_path / "o1")
    assert code == 0 and "warning" not in err, err  # the A it was aligned to


# ----------------------------------------------------------------------------- tokenizers, train checkpoints


@pytest.mark.parametrize("stream", ["--no-stream", "--stream"])
def test_b_without_tokenizer_files_is_refused_like_a(stream, tmp_path, monkeypatch, capsys, tok):
    a = gpt2(tmp_path / "A", tok, seed=0)
    b = gpt2(tmp_path / "B", tok, seed=1)
    for f in b.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            f.unlink()
    text = tmp_path / "t.txt"
    text.write_text(corpus(40, seed=3))
    args = ["--data", text, "--context", "16", "--eval-items", "4", "--points", "2", stream]
    _no_work(monkeypatch, "symalign.jobs.interpolate:curve")
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", b, a, *args, "-o", tmp_path / "o")
    _refused(code, err, f"{b} has no tokenizer files", "--tokenizer")  # as A (already refused before)
    first = _one_line(err)
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, *args, "-o", tmp_path / "o")
    _refused(code, err, f"{b} has no tokenizer files", "--tokenizer")  # and now as B: the same line
    assert _one_line(err) == first
    assert not (tmp_path / "o").exists()


def test_train_checkpoints_are_refused_in_one_line(pair, tmp_path, monkeypatch, capsys):
    from symalign.checkpoint import save_run
    from symalign.models import build_model
    from symalign.models.config import ModelConfig

    cfg = ModelConfig(family="vit", d_model=8, n_layers=1, n_heads=2, image_size=8, patch_size=4, n_classes=10)
    run = tmp_path / "tr0"
    ckpt = save_run(run, build_model(cfg, seed=0), {"model": cfg.to_dict(), "step": 20})
    a, _ = pair
    for path in (ckpt, run):
        code, _, err = run_symalign(monkeypatch, capsys, "align", path, a, "-o", tmp_path / "out")
        _refused(code, err, str(path), "`symalign train`", "symalign experiment")
        code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a, path, "--data", "digits")
        _refused(code, err, "`symalign train`")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- --threads


COMPUTING = ("align", "interpolate", "merge", "probe", "tour", "sweep", "train", "experiment", "demo")


@pytest.mark.parametrize("command", COMPUTING)
def test_every_computing_command_takes_threads(command, monkeypatch, capsys):
    code, out, _ = run_symalign(monkeypatch, capsys, command, "--help")
    assert code == 0 and "--threads" in out


def test_threads_is_used_and_checked(pair, tmp_path, monkeypatch, capsys):
    code, out, err = run_symalign(monkeypatch, capsys, "probe", "--threads", "2", "--json")
    assert code == 0, err
    assert torch.get_num_threads() == 2
    a, b = pair
    code, out, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", tmp_path / "o", "--threads", "3",
                                  "--json")
    assert code == 0 and json.loads(out)["threads"] == 3, err
    for command, args in (("align", [a, b, "-o", tmp_path / "x"]), ("merge", [a, b, "-o", tmp_path / "x"]),
                          ("tour", ["-o", tmp_path / "x"])):
        code, _, err = run_symalign(monkeypatch, capsys, command, *args, "--threads", "0")
        _refused(code, err, "--threads")
    assert not (tmp_path / "x").exists()
