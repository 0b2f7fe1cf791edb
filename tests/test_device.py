"""``--device`` / ``device=``: one place resolves it, refuses what this machine lacks, and the CPU path is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from symalign.device import describe, exact_matmul, out_of_memory, resolve
from symalign.errors import ConfigError

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_resolve_accepts_the_documented_forms():
    assert resolve("cpu") == torch.device("cpu") and resolve(" CPU ") == torch.device("cpu")
    assert resolve("auto") == resolve(None) == (torch.device("cuda", 0) if torch.cuda.is_available()
                                                 else torch.device("cpu"))


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:1", "tpu", "", "cuda:-1"])
def test_unknown_device_strings_are_refused_in_one_line(bad):
    if bad == "":
        assert resolve(bad) == resolve("auto")  # empty means the default
        return
    with pytest.raises(ConfigError, match="unknown --device") as exc:
        resolve(bad)
    assert "\n" not in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_refused(spec):
    with pytest.raises(ConfigError, match="use --device cpu") as exc:
        resolve(spec)
    assert "\n" not in str(exc.value)


def test_describe_and_out_of_memory_message():
    assert describe("cpu") == {"device": "cpu"} and describe(None) == {"device": "cpu"}
    msg = str(out_of_memory("cuda:0", "matching layer 3"))
    assert "--stream" in msg and "--max-device-memory" in msg and "--batch-size" in msg and "\n" not in msg


def test_exact_matmul_turns_tf32_off_and_restores_the_callers_setting():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    try:
        with pytest.raises(RuntimeError):
            with exact_matmul():
                assert torch.backends.cuda.matmul.allow_tf32 is False
                assert torch.get_float32_matmul_precision() == "highest"
                raise RuntimeError("inside")
        assert torch.backends.cuda.matmul.allow_tf32 is True and torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


def test_provenance_records_the_device():
    from symalign.provenance import provenance

    rec = provenance(command="x", threads=1)
    assert rec["device"] == "cpu" and "gpu" not in rec


def test_provenance_records_the_cpu_model():
    """Native arithmetic differs between CPUs of one instruction-set class: the model name is recorded."""
    import symalign.provenance as prov

    rec = prov.provenance(command="x", threads=1)
    assert "cpu" in rec["machine"]
    if Path("/proc/cpuinfo").is_file():
        want = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), None)
        if want:
            assert rec["machine"]["cpu"] == want


def _pair(seed=0):
    from hf_tiny import make_model
    from symalign.families import get_adapter
    from symalign.spec import apply, sample

    a = make_model("llama", dtype=torch.float64, seed=seed)
    spec = get_adapter(a).spec(a)
    sa = a.state_dict()
    return spec, sa, apply(spec, sample(spec, seed + 5), sa)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_match_attention_on_a_device_equals_the_default(device):
    pytest.importorskip("transformers")
    from symalign.match import match_attention

    spec, sa, sb = _pair()
    ref = match_attention(spec, sa, sb)
    got = match_attention(spec, sa, sb, device=device)
    for k, v in ref.transform.items():
        w = got.transform[k]
        assert w.device.type == "cpu"
        if device == "cpu":
            assert torch.equal(v, w), k  # the same code on the same device: bit for bit
        elif v.is_floating_point():
            # the V-O GL element is L-BFGS's, stopped on a tolerance: at a planted pair (objective ~1e-14 on both
            # devices) its entries are resolved to about sqrt(eps) -- 3e-9 apart on an H200 -- not to 1e-10
            assert float((v - w).abs().max()) <= 1e-8 * float(v.abs().max()), k
        else:
            assert torch.equal(v, w), k


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_match_whole_on_a_device_equals_the_default(device):
    pytest.importorskip("transformers")
    from symalign.families import get_adapter, prepare
    from hf_tiny import make_model
    from symalign.match.whole import match_whole
    from symalign.spec import apply, sample

    a = make_model("llama", dtype=torch.float64, seed=1)
    ad = get_adapter(a)
    pa = prepare(a.config, a.state_dict(), ad.spec(a.config, a.state_dict().keys()))
    sb = apply(pa.spec, sample(pa.spec, 9), pa.state)
    ref = match_whole(pa.spec, pa.state, sb, max_sweeps=3)
    got = match_whole(pa.spec, pa.state, sb, max_sweeps=3, device=device)
    assert ref.distances == got.distances if device == "cpu" else True
    for k, v in ref.transform.items():
        assert got.transform[k].device.type == "cpu"
        assert torch.equal(v, got.transform[k]) if device == "cpu" else torch.allclose(v, got.transform[k])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
def test_lmc_curve_on_a_device_equals_the_default(device):
    from torch import nn

    from symalign import lmc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    sa = lmc.full_state(model)
    sb = {k: v + 0.1 * torch.randn_like(v) for k, v in sa.items()}
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))

    def batches():
        yield x, y

    ref = lmc.curve(model, sa, sb, batches, points=4)
    got = lmc.curve(model, sa, sb, batches, points=4, device=device)
    assert got.loss == ref.loss if device == "cpu" else got.loss == pytest.approx(ref.loss, rel=1e-9)


# -- the CLI: --device on every command that computes -------------------------------------------------------------

def _vit(path, seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4, num_channels=1, num_labels=10)
    transformers.ViTForImageClassification(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_align_device_cpu_is_bit_identical_to_the_default(scope, tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign

    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    for out, extra in (("D", []), ("C", ["--device", "cpu"])):
        code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", tmp_path / out, "--scope", scope,
                                    *extra)
        assert code == 0, err
    assert (tmp_path / "D" / "model.safetensors").read_bytes() == (tmp_path / "C" / "model.safetensors").read_bytes()
    marker = json.loads((tmp_path / "C" / "symalign.json").read_text())
    assert marker["command"] == "align"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["align", "merge", "interpolate", "probe", "experiment"])
def test_device_cuda_without_cuda_exits_2_in_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign

    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)

    def boom(*args, **kwargs):
        raise AssertionError("weights were loaded before the device was checked")

    monkeypatch.setattr("symalign.checkpoint.hf.load_checkpoint", boom)
    monkeypatch.setattr("symalign.jobs.interpolate.load_hf_model", boom)
    args = {"align": [a, b, "-o", tmp_path / "O"], "merge": [a, b, "-o", tmp_path / "O"],
            "interpolate": [a, b, "--data", "digits", "-o", tmp_path / "O"], "probe": [],
            "experiment": [Path(__file__).resolve().parents[1] / "configs" / "vit-digits-rope.toml", "--out",
                           tmp_path / "runs"]}[command]
    code, out, err = run_symalign(monkeypatch, capsys, command, *args, "--device", "cuda")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "use --device cpu" in lines[0], err
    assert not (tmp_path / "O").exists() and not (tmp_path / "runs" / "vit-digits-rope").exists()


def test_merge_interpolate_and_probe_take_device_cpu(tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign

    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    code, out, err = run_symalign(monkeypatch, capsys, "merge", a, b, "-o", tmp_path / "M", "--device", "cpu",
                                  "--json", "--scope", "attention")
    assert code == 0, err
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, tmp_path / "M", "--data", "digits",
                                  "--points", "3", "--eval-items", "16", "-o", tmp_path / "I", "--device", "cpu",
                                  "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["device"] == "cpu"
    code, out, err = run_symalign(monkeypatch, capsys, "probe", "--device", "cpu", "--json", "--d-model", "8",
                                  "--heads", "2")
    assert code == 0, err
    ref_code, ref, _ = run_symalign(monkeypatch, capsys, "probe", "--json", "--d-model", "8", "--heads", "2")
    drop = ("seconds", "time_s")
    strip = lambda d: {k: v for k, v in d.items() if k not in drop}  # noqa: E731
    assert strip(json.loads(out)) == strip(json.loads(ref))  # the same measurement on the same device


def _decoder_pair(tmp: Path, family: str, **kw) -> tuple[Path, Path]:
    """A float64 pair of ``family`` (a tiny Llama, or a tiny mixture of experts: unit steps other than plain FF
    permutations), sharded."""
    pytest.importorskip("transformers")
    from hf_families import make as make_family
    from test_family_moe import make as make_moe

    for seed, name in ((0, "A"), (1, "B")):
        m = make_moe(family, seed=seed, **kw) if family == "mixtral" else make_family(family, dtype=torch.float64,
                                                                                        seed=seed, **kw)
        m.save_pretrained(tmp / name, max_shard_size="20KB")
    return tmp / "A", tmp / "B"


def _whole(a_dir: Path, b_dir: Path, device, stage2: str = "full") -> tuple[object, dict]:
    """:class:`StreamedWhole` over the resident pair on ``device`` (3 passes), and B aligned into a state dict."""
    from symalign.align_result import PhaseClock
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.match.whole import CHECKPOINT_SETTINGS
    from symalign.stream.fold import added_tensors
    from symalign.stream.model import StreamedWhole, write_aligned
    from symalign.stream.sink import StateSink

    a, b = ResidentCheckpoint.of(load_checkpoint(a_dir)), ResidentCheckpoint.of(load_checkpoint(b_dir))
    w = StreamedWhole(a, b, device=device)
    w.match(True, stage2, 3, CHECKPOINT_SETTINGS["rtol"], False)
    sink = StateSink(b, extra=added_tensors(b, w.prep_b))
    write_aligned(w, sink, PhaseClock(), progress=False)
    return w, sink.state


def _worst(got: dict, want: dict) -> float:
    """``max |got - want|`` over the tensors, relative to the largest entry of ``want``."""
    scale = max(float(v.double().abs().max()) for v in want.values() if v.numel())
    return max(float((got[k].double() - v.double()).abs().max()) for k, v in want.items() if v.numel()) / scale


@pytest.mark.parametrize("family,kw", [("llama", {}), ("mixtral", {"tie_word_embeddings": False})])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])])
@pytest.mark.parametrize("stage2", ["orthogonal", "full"])
@pytest.mark.slow
def test_streamed_whole_on_a_device_equals_the_default(family, kw, device, stage2, tmp_path):
    """The whole-model passes (:class:`StreamedWhole`) with ``device``: on the CPU the same steps with no-op moves,
    bit for bit the default; on CUDA (float64, TF32 off) the same distances to 1e-10 of the unaligned one, every
    transform back on the CPU, and B aligned to 1e-10 of its largest weight (on one H200: 3e-15 with the
    closed-form stage 2, 6e-12 with the iterative GL solve of stage 2 full)."""
    a_dir, b_dir = _decoder_pair(tmp_path, family, **kw)
    ref, want = _whole(a_dir, b_dir, None, stage2)
    w, got = _whole(a_dir, b_dir, device, stage2)
    assert w.device.type == device and ref.device is None
    assert all(v.device.type == "cpu" for v in w.transform().values())
    assert set(got) == set(want) and w.changes == ref.changes
    if device == "cpu":
        assert w.distances == ref.distances
        for k, v in ref.transform().items():
            assert torch.equal(v, w.transform()[k]), k
        for k, v in want.items():
            assert torch.equal(v, got[k]), k
        return
    d0 = ref.distances[0]
    gap = max(abs(x - y) for x, y in zip(w.distances, ref.distances)) / d0
    worst = _worst(got, want)
    print(f"{family} stage2={stage2}: distances {gap:.3g} of the unaligned, tensors {worst:.3g} of the largest")
    assert len(w.distances) == len(ref.distances) and gap <= 1e-10, (w.distances, ref.distances)
    assert worst <= 1e-10


@pytest.mark.parametrize("command,stream", [("align", True), ("align", False), ("merge", False), ("merge", True)])
@pytest.mark.slow
def test_model_scope_device_cpu_is_bit_identical_to_the_default_on_a_decoder(command, stream, tmp_path,
                                                                               monkeypatch):
    """``device`` reaches the whole-model passes of ``align``/``merge --scope model``, streamed and in memory (a
    Llama: :class:`StreamedWhole` both ways), and with the CPU OUT is byte for byte that of no device (the CLI's
    ``--device`` default, ``auto``, resolves to the CPU here)."""
    from safetensors.torch import load_file

    import symalign.stream.model as sm
    from symalign.commands.align import run_align
    from symalign.commands.merge import run_merge

    a, b = _decoder_pair(tmp_path, "llama")
    seen: list = []
    real = sm.StreamedWhole.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        seen.append(self.device)

    monkeypatch.setattr(sm.StreamedWhole, "__init__", spy)
    for out, device in (("D", None), ("C", torch.device("cpu"))):
        if command == "align":
            run_align(a, b, tmp_path / out, scope="model", max_sweeps=2, stream=stream, progress=False,
                      device=device)
        else:
            run_merge([a, b], tmp_path / out, scope="model", max_sweeps=2, stream=stream, progress=False,
                      device=device)
    assert seen == [None, torch.device("cpu")]

    def state(d: Path) -> dict:
        st: dict = {}
        for f in sorted(d.glob("*.safetensors")):
            st.update(load_file(str(f)))
        return st

    want, got = state(tmp_path / "D"), state(tmp_path / "C")
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
