"""The README's ``align --scope model`` -> ``interpolate`` flow measures the aligned path (issue 24).

``--scope model`` writes OUT = T . fold(B) (norm gains folded; GPT-2: head untied). The path the
solver made short is ``(1 - t) fold(A) + t OUT``. ``interpolate A OUT`` must measure exactly that
path (it folds A itself when OUT is marked folded), and ``--write-reference REF`` writes fold(A).
The test measures the midpoint directly in the solver's coordinates (fold(A) from
:func:`symalign.families.prepare`, OUT's tensors) and compares.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _cli_util import run_symalign  # noqa: E402
from hf_tiny import randomize  # noqa: E402


def _gpt2(path, seed):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=256, n_positions=64)
    m = transformers.GPT2LMHeadModel(cfg)
    randomize(m, seed)
    m.save_pretrained(path)
    return path, ["synthetic", "--data-option", "kind=lm", "--context", "16", "--tokenizer", "bytes"]


def _vit(path, seed):
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4, num_channels=1, num_labels=10)
    m = transformers.ViTForImageClassification(cfg)
    randomize(m, seed)
    m.save_pretrained(path)
    return path, ["digits"]


def _midpoint_in_solver_coordinates(a_dir, out_dir, tmp, data_args):
    """Loss of 0.5 (fold(A) + OUT), built from the solver's tensors, on the same evaluation batches."""
    from safetensors.torch import load_file, save_file

    from symalign.checkpoint import hf as hf_io
    from symalign.evaluate import EvalOptions, build_eval, evaluate_model
    from symalign.jobs.interpolate import load_hf_model
    from symalign.families import prepare

    a = hf_io.load_checkpoint(a_dir)
    folded_a = prepare(a.config, a.state, a.adapter.spec(a.config, a.state.keys())).state
    out_state = load_file(str(out_dir / "model.safetensors"))
    assert set(folded_a) == set(out_state)
    mid_dir = tmp / "mid"
    shutil.copytree(out_dir, mid_dir)
    save_file({k: (0.5 * (folded_a[k].double() + out_state[k].double())).to(out_state[k].dtype).contiguous()
               for k in out_state}, str(mid_dir / "model.safetensors"), metadata={"format": "pt"})
    model = load_hf_model(mid_dir)
    lm = data_args[0] == "synthetic"
    opts = EvalOptions(eval_items=32, context=16 if lm else None, tokenizer="bytes" if lm else None,
                       data_options={"kind": "lm"} if lm else {})
    with torch.no_grad():
        return evaluate_model(model, build_eval(a_dir, model, data_args[0], opts)).loss


@pytest.mark.parametrize("make", [_gpt2, _vit], ids=["gpt2", "vit"])
@pytest.mark.slow
def test_interpolate_measures_the_aligned_path(make, tmp_path, monkeypatch, capsys):
    a, data_args = make(tmp_path / "A", 0)
    b, _ = make(tmp_path / "B", 1)
    out, ref = tmp_path / "OUT", tmp_path / "REF"
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, "--scope", "model",
                                "--write-reference", ref, "--max-sweeps", "3")
    assert code == 0, err
    assert json.loads((out / "symalign.json").read_text())["folded"] is True
    assert json.loads((ref / "symalign.json").read_text())["folded"] is True
    common = ["--data", *data_args, "--points", "3", "--eval-items", "32", "--json"]
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", a, out, *common, "-o", tmp_path / "i1")
    assert code == 0, err
    res = json.loads(stdout)
    assert res["a_folded"] is True
    want = _midpoint_in_solver_coordinates(a, out, tmp_path, data_args)
    assert res["curve"]["loss"][1] == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the written reference gives the same path, and A's folded form has A's loss
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", ref, out, *common, "-o", tmp_path / "i2")
    assert code == 0, err
    res2 = json.loads(stdout)
    assert res2["a_folded"] is False
    assert res2["curve"]["loss"] == pytest.approx(res["curve"]["loss"], rel=1e-5, abs=1e-6)
    code, stdout, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, *common, "-o", tmp_path / "i3")
    assert json.loads(stdout)["curve"]["loss"][0] == pytest.approx(res["curve"]["loss"][0], rel=1e-5, abs=1e-6)


def test_write_reference_needs_model_scope(tmp_path, monkeypatch, capsys):
    a, _ = _vit(tmp_path / "A", 0)
    b, _ = _vit(tmp_path / "B", 1)
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", tmp_path / "OUT", "--write-reference",
                                tmp_path / "REF")
    assert code == 2 and "--scope model" in err
    assert not (tmp_path / "OUT").exists() and not (tmp_path / "REF").exists()
