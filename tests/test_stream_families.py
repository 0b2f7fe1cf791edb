"""Streamed ``--scope model`` (``align`` and ``merge``) for every decoder family: the same result as in
memory, B's function through transformers' own forward, and one-line refusals where streaming cannot be exact.

The residual group is the one the family's rewrite declares (docs/scaling.md): ``O(D)`` for pre-RMSNorm
families with an untied head (Llama, Qwen3, Phi-3, Gemma), ``O_1(D)`` for LayerNorm families (GPT-2, GPT-NeoX,
GPT-J, Phi, Falcon), ``S_D`` with post-norms (OLMo 2, Gemma 2/3) or a tied head on an RMSNorm stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign
from symalign.families import get_adapter
from symalign.families.encoder import EncoderFamily

from hf_families import case_id, cases, float64_numerics, make as make_family, registered
from hf_tiny import T, make_model
from test_stream import _nothing_written, _state

# (family, config overrides, residual group the rewrite declares): every declared case with a residual group
DENSE = [(f, c.kw, c.residual) for f, c in cases(lambda c: c.residual is not None)]
IDS = [case_id(f, kw) for f, kw, _ in DENSE]


def streamed(check: str, keep=lambda c: True) -> list[tuple[str, dict]]:
    """The declared cases asking for the streamed ``check`` (``Case.streamed``)."""
    return [(f, c.kw) for f, c in cases(lambda c: check in c.streamed and keep(c))]


def _untied(case) -> bool:
    """A LayerNorm stream with a tied head: the rewrite unties it."""
    return bool(case.kw.get("tie_word_embeddings")) and (case.residual or "").startswith("O_1")


FLOAT32, BIG = streamed("float32"), streamed("big")
MERGE, MERGE_UNTIED = streamed("merge", lambda c: not _untied(c)), streamed("merge", _untied)
# a LayerNorm family's plain case (its residual group O_1(D) must fix 1)
LAYER_NORM = next(f for f, c in cases(lambda c: (c.residual or "").startswith("O_1") and not c.kw))
# families aligned in memory only at --scope model (their declared streamed scopes lack it)
IN_MEMORY_ONLY = [f for f, fam in registered() if "model" in fam.scopes.memory and "model" not in fam.scopes.stream]


def _pair(tmp: Path, family: str, dtype=torch.float64, shard: str | None = "20KB", **kw):
    for seed, name in ((0, "A"), (1, "B")):
        m = make_family(family, dtype=dtype, seed=seed, **kw)
        if shard:
            m.save_pretrained(tmp / name, max_shard_size=shard)
        else:
            m.save_pretrained(tmp / name)
    return tmp / "A", tmp / "B"


def _worst(x: dict, y: dict) -> float:
    """``max |x - y|`` over the tensors, relative to the largest entry of ``y``."""
    assert set(x) == set(y)
    scale = max(float(v.double().abs().max()) for v in y.values() if v.numel())
    return max(float((x[k].double() - y[k].double()).abs().max()) for k in y if y[k].numel()) / scale


def _same(x: dict, y: dict) -> bool:
    """The same tensors bit for bit (names, dtypes, values): the in-memory and streamed model scope are one loop
    (:class:`symalign.stream.model.StreamedWhole`) over resident or lazily read sources."""
    assert set(x) == set(y)
    bad = [k for k in y if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    assert not bad, bad[:3]
    return True


def _logits(model, vocab: int = 64) -> torch.Tensor:
    ids = torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def _loaded(path: Path, dtype):
    moe = json.loads((path / "config.json").read_text())["model_type"] in ("mixtral", "qwen2_moe", "olmoe")
    kw = {"experts_implementation": "eager"} if moe else {}
    m = T.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kw).eval()
    return float64_numerics(m) if dtype == torch.float64 else m


def _function_change(b_dir: Path, out: Path, dtype) -> float:
    """``||f_OUT - f_B|| / ||f_B||``, both loaded by ``from_pretrained`` and run by transformers' forward
    (float64: RMSNorms and softmax evaluated in float64, :func:`float64_numerics`)."""
    y0, y1 = _logits(_loaded(b_dir, dtype)), _logits(_loaded(out, dtype))
    return float((y1 - y0).norm() / y0.norm())


def _merge_both(monkeypatch, capsys, tmp_path, da, db) -> dict:
    """``merge --scope model`` of ``da, db`` (weights 0.4, 0.6) in memory to ``MEM`` and streamed to ``STR``; the
    streamed run's JSON."""
    args = [da, db, "--scope", "model", "--weights", "0.4,0.6", "--max-sweeps", "2", "--json"]
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "STR", "--stream")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("family,kw,group", DENSE, ids=IDS)
@pytest.mark.slow
def test_streamed_model_scope_equals_in_memory_float64(family, kw, group, tmp_path):
    """float64 checkpoints, sharded: in memory and streamed are the same passes over resident or lazy sources (the
    same distances, the same tensors bit for bit, an untied head too), every layer passes the per-layer check
    (``layer'(O x) = O layer(x)``), and OUT computes B's function."""
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, family, **kw)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=3)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=3)
    assert (s.path, m.path) == ("streamed", "in-memory")
    assert s.group["spaces"]["residual"] == m.group["spaces"]["residual"] == group, (s.group, m.group)
    ds, dm = s.match["distances"], m.match["distances"]
    assert ds == dm and ds[-1] < ds[0]
    assert s.distance["before"] == m.distance["before"]  # after: in memory formed from the written tensors
    assert abs(s.distance["after"]["total"] - m.distance["after"]["total"]) <= 1e-9 * m.distance["after"]["total"]
    check = s.check.to_dict()
    assert check["passed"] and check["exact"]["rel"] < 1e-12
    assert _same(_state(tmp_path / "S"), _state(tmp_path / "M"))
    tied = bool(json.loads((da / "config.json").read_text()).get("tie_word_embeddings"))
    assert s.untied_head == m.untied_head == (tied and group.startswith("O_1"))
    if s.untied_head:
        assert json.loads((tmp_path / "S" / "config.json").read_text())["tie_word_embeddings"] is False
        index = json.loads((tmp_path / "S" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(_state(tmp_path / "S"))
    assert _function_change(db, tmp_path / "S", torch.float64) <= 1e-10


@pytest.mark.parametrize("family,kw", FLOAT32, ids=[case_id(f, kw) for f, kw in FLOAT32])
@pytest.mark.slow
def test_streamed_model_scope_float32_single_file(family, kw, tmp_path):
    """float32, one file: OUT stays float32, equals the in-memory output bit for bit (both fold and match in
    float64 and round only what they write), and computes B's function through transformers to 1e-5."""
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, family, dtype=torch.float32, shard=None, **kw)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=2)
    run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=2)
    assert s.path == "streamed" and s.check.to_dict()["passed"]
    out = _state(tmp_path / "S")
    assert all(v.dtype == torch.float32 for v in out.values() if v.is_floating_point())
    assert _same(out, _state(tmp_path / "M"))
    assert _function_change(db, tmp_path / "S", torch.float32) <= 1e-5


@pytest.mark.parametrize("family,kw", BIG, ids=[case_id(f, kw) for f, kw in BIG])  # a tied head: in row chunks
@pytest.mark.slow
def test_big_tensor_path_equals_in_memory(family, kw, monkeypatch, tmp_path):
    """At scale every weight is folded on its own (the gains and biases held) and the embedding and head in row
    chunks: forced here on tiny models, streamed, against the in-memory run without that forcing (the same passes,
    whole tensors). A LayerNorm reader's bias ``c + W b`` comes from the call given ``W`` (GPT-2's ``Conv1D``
    stores ``W^T``; GPT-J's head has a bias, folded chunk by chunk), Phi's Q/K centring works on whole tensors:
    the result is the in-memory one (to float64 rounding: the residual cross-Gram is summed over other chunks)."""
    import symalign.stream.model as sm
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, family, shard=None, **{"tie_word_embeddings": False, **kw})
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=2)
    monkeypatch.setattr(sm, "SMALL_ELEMENTS", 200)  # every 2-d weight counts as big; gains and biases do not
    monkeypatch.setattr(sm, "CHUNK_ELEMENTS", 100)  # the embedding and head in chunks of a few rows
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=2)
    assert all(abs(x - y) <= 1e-11 * m.match["distances"][0] for x, y in zip(s.match["distances"],
                                                                              m.match["distances"]))
    assert _worst(_state(tmp_path / "S"), _state(tmp_path / "M")) <= 1e-10


def _merge(monkeypatch, capsys, *args):
    return run_symalign(monkeypatch, capsys, "merge", *map(str, args))


@pytest.mark.parametrize("family,kw", MERGE, ids=[case_id(f, kw) for f, kw in MERGE])
def test_streamed_model_scope_merge_equals_in_memory(family, kw, tmp_path, capsys, monkeypatch):
    """merge --stream --scope model = the in-memory merge --scope model (A averaged in its folded form, B aligned
    by the streamed passes), float64; the merge loads with from_pretrained."""
    import symalign.stream.merge as smerge
    from symalign.jobs.interpolate import load_hf_model

    chunks = smerge.row_chunks
    monkeypatch.setattr(smerge, "row_chunks", lambda shape: chunks(shape, 100))  # the folded A in row chunks
    da, db = _pair(tmp_path, family, **kw)
    info = _merge_both(monkeypatch, capsys, tmp_path, da, db)
    assert info["scope"] == "model" and info["aligned"][0]["check"]["passed"]
    assert _same(_state(tmp_path / "STR"), _state(tmp_path / "MEM"))
    load_hf_model(tmp_path / "STR")


@pytest.mark.parametrize("family,kw", MERGE_UNTIED, ids=[case_id(f, kw) for f, kw in MERGE_UNTIED])
@pytest.mark.slow
def test_merge_with_an_untied_head_equals_in_memory(family, kw, tmp_path, capsys, monkeypatch):
    """A LayerNorm stream with a tied head: the rewrite unties it, in both checkpoints. The streamed merge reads
    the first checkpoint's head as the folded rows of its embedding, appends it to the last shard (row chunks
    here), sets tie_word_embeddings false: the in-memory merge, loadable by from_pretrained."""
    import symalign.stream.merge as smerge
    from symalign.jobs.interpolate import load_hf_model

    chunks = smerge.row_chunks
    monkeypatch.setattr(smerge, "row_chunks", lambda shape: chunks(shape, 100))
    da, db = _pair(tmp_path, family, **kw)
    args = [da, db, "--scope", "model", "--max-sweeps", "2", "--json"]
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "MEM", "--no-stream")
    assert code == 0, err
    code, out, err = _merge(monkeypatch, capsys, *args, "-o", tmp_path / "STR", "--stream")
    assert code == 0, err
    st = _state(tmp_path / "STR")
    assert len(st) == len(_state(da)) + 1 and _same(st, _state(tmp_path / "MEM"))
    assert json.loads((tmp_path / "STR" / "config.json").read_text())["tie_word_embeddings"] is False
    load_hf_model(tmp_path / "STR")


def _moe_pair(tmp: Path, family: str, **kw):
    from test_family_moe import make as make_moe

    for seed, name in ((0, "A"), (1, "B")):
        make_moe(family, seed=seed, **kw).save_pretrained(tmp / name, max_shard_size="20KB")
    return tmp / "A", tmp / "B"


MOE = [("mixtral", {"tie_word_embeddings": False}, "O(16)"), ("mixtral", {"tie_word_embeddings": True}, "S_16"),
       ("qwen2_moe", {"tie_word_embeddings": False}, "O(16)"),
       ("qwen2_moe", {"tie_word_embeddings": False, "mlp_only_layers": [1]}, "O(16)"),  # a dense layer too
       ("olmoe", {"tie_word_embeddings": False}, "O(16)"), ("olmoe", {"tie_word_embeddings": True}, "S_16")]


@pytest.mark.parametrize("family,kw,group", MOE, ids=[f"{f}-{'-'.join(map(str, kw.values()))}" for f, kw, _ in MOE])
@pytest.mark.slow
def test_mixture_of_experts_streamed_equals_in_memory(family, kw, group, tmp_path):
    """Mixtral, Qwen2-MoE, OLMoE (float64, sharded, one tensor per expert on disk): each layer is read and
    prepared whole in transformers' fused layout, the expert blocks solved by match_whole's own step
    (symalign.match.experts), the layer checked in the fused layout and written back one tensor per expert:
    the same distances and tensors as in memory, and B's function through from_pretrained."""
    from symalign.commands.align import run_align

    da, db = _moe_pair(tmp_path, family, **kw)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=2)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=2)
    assert s.path == "streamed" and s.group["spaces"]["residual"] == m.group["spaces"]["residual"] == group
    assert s.match["distances"] == m.match["distances"]
    assert s.check.to_dict()["passed"] and s.check.to_dict()["exact"]["rel"] < 1e-12
    out = _state(tmp_path / "S")
    assert set(out) == set(_state(db)) and _same(out, _state(tmp_path / "M"))
    assert _function_change(db, tmp_path / "S", torch.float64) <= 1e-10


def _near_tie_router(model) -> None:
    """Each layer's router made to sit on a top-2 boundary: rows 0-2 equal but for one bfloat16 ulp of one
    coordinate each (a token with ``r x > 0`` picks two of three nearly tied experts), rows 3-7 ``-(1 + e/10) r``
    (distinct: a token with ``r x < 0`` picks rows 7 and 6)."""
    with torch.no_grad():
        for layer in model.model.layers:
            w = layer.mlp.gate.weight
            r = w[0].clone()
            for e in range(w.shape[0]):
                w[e] = r if e < 3 else -(1 + e / 10) * r
            for e in (1, 2):
                w[e, e] = torch.nextafter(w[e, e], torch.tensor(10.0, dtype=w.dtype))


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.slow
def test_mixture_of_experts_bfloat16_check_is_not_refused_by_routing_flips(stream, tmp_path):
    """A bfloat16 Mixtral with top-2 routing whose routers sit on a top-2 boundary: rounding the aligned layer
    to bfloat16 flips which of the tied experts some tokens pick, a jump of the block's output that is not an
    error of the transform. The function checks route every expert (MoEFamily.function_check_config), so they
    pass (before: refused; streamed, the per-layer check by 0.18 relative on layer 0 as stored; in memory, the
    whole-model check by 0.39), and OUT keeps B's top-2 routing in its config."""
    from test_family_moe import make as make_moe

    from symalign.commands.align import run_align

    for seed, name in ((0, "A"), (1, "B")):
        m = make_moe("mixtral", dtype=torch.bfloat16, seed=seed, hidden_size=64, intermediate_size=32,
                     num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
        if name == "B":
            _near_tie_router(m)
        m.save_pretrained(tmp_path / name, max_shard_size="200KB")
    s = run_align(tmp_path / "A", tmp_path / "B", tmp_path / "S", scope="model", stream=stream, max_sweeps=1)
    check = s.check.to_dict()
    assert check["passed"] and check["rel"] < 6.25e-2, check
    assert not stream or check["exact"]["rel"] < 1e-12
    assert json.loads((tmp_path / "S" / "config.json").read_text())["num_experts_per_tok"] == 2  # OUT: B's k


@pytest.mark.parametrize("command", ["align", "merge"])
@pytest.mark.slow
def test_mixture_of_experts_experts_option_reaches_the_streamed_passes(command, tmp_path, capsys, monkeypatch):
    """``--experts paired`` with ``--stream`` (align, merge): every expert block is solved by the paired method."""
    import symalign.match.whole as whole

    da, db = _moe_pair(tmp_path, "mixtral", tie_word_embeddings=False)
    seen: list[str] = []
    real = whole.match_experts

    def spy(*args, method="exact", **kw):
        seen.append(method)
        return real(*args, method=method, **kw)

    monkeypatch.setattr(whole, "match_experts", spy)
    code, out, err = run_symalign(monkeypatch, capsys, command, da, db, "-o", tmp_path / "OUT", "--stream",
                                  "--scope", "model", "--experts", "paired", "--max-sweeps", "2", "--json")
    assert code == 0, err
    assert "stream" in json.loads(out) and seen and set(seen) == {"paired"}


@pytest.mark.parametrize("family,kw", [("mixtral", {"tie_word_embeddings": False}),
                                       ("qwen2_moe", {"tie_word_embeddings": False, "mlp_only_layers": [1]}),
                                       ("olmoe", {"tie_word_embeddings": True})])
@pytest.mark.slow
def test_mixture_of_experts_merge_equals_in_memory(family, kw, tmp_path, capsys, monkeypatch):
    """merge --stream --scope model of a mixture of experts = the in-memory merge: the first checkpoint is folded a
    layer at a time (its experts fold stacked) and read back one tensor per expert; the merge loads."""
    from symalign.jobs.interpolate import load_hf_model

    da, db = _moe_pair(tmp_path, family, **kw)
    assert _merge_both(monkeypatch, capsys, tmp_path, da, db)["aligned"][0]["check"]["passed"]
    assert set(_state(tmp_path / "STR")) == set(_state(da))
    assert _same(_state(tmp_path / "STR"), _state(tmp_path / "MEM"))
    load_hf_model(tmp_path / "STR")


def test_layer_check_refuses_a_residual_that_moves_ones(tmp_path, monkeypatch):
    """O_1(D) means rotations fixing 1: the per-layer check (through transformers' LayerNorm, which centres)
    refuses to write OUT when the residual element is a rotation of O(D) that moves 1, although it is exact on
    the folded weights' Frobenius geometry."""
    import symalign.stream.model as sm
    from symalign.errors import SymalignError
    from symalign.groups import Orthogonal

    da, db = _pair(tmp_path, LAYER_NORM, shard=None)
    real = sm.StreamedWhole.match

    def moved(self, *a, **k):
        out = real(self, *a, **k)
        self.O = self.O @ Orthogonal(self.group.n).sample(3)  # no longer fixes 1
        return out

    monkeypatch.setattr(sm.StreamedWhole, "match", moved)
    with pytest.raises(SymalignError, match="differs from O times B's layer"):
        sm.run_stream_model(da, db, tmp_path / "OUT", max_sweeps=1, progress=False)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("family", IN_MEMORY_ONLY)
def test_in_memory_only_families_refused_in_one_line(family, tmp_path, capsys, monkeypatch):
    """The families whose declared streamed scopes lack ``model`` (the encoders, T5) are refused in one line."""
    for seed, name in ((0, "A"), (1, "B")):
        make_model(family, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    code, out, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                  tmp_path / "OUT", "--stream", "--scope", "model")
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and ("--no-stream" in lines[0] or "without --stream" in lines[0]), err
    assert "encoder" in lines[0] or not isinstance(get_adapter({"model_type": family}), EncoderFamily)
    assert _nothing_written(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.slow
def test_streamed_model_scope_equals_in_memory_on_16_bit_checkpoints(dtype, tmp_path, monkeypatch, capsys):
    """16-bit checkpoints: both paths fold and match in float64 and round only what they write, so ``align`` and
    ``merge --scope model`` give the same tensors bit for bit streamed and in memory (they used to start from
    differently rounded folded weights and end in other permutations: up to 0.6 relative on MLP tensors)."""
    from symalign.commands.align import run_align

    da, db = _pair(tmp_path, "llama", dtype=dtype)
    s = run_align(da, db, tmp_path / "S", scope="model", stream=True, max_sweeps=3)
    m = run_align(da, db, tmp_path / "M", scope="model", stream=False, max_sweeps=3)
    assert s.match["distances"] == m.match["distances"]
    assert _same(_state(tmp_path / "S"), _state(tmp_path / "M"))
    for path in ("S", "M"):
        assert all(v.dtype == dtype for v in _state(tmp_path / path).values() if v.is_floating_point())
    for name, extra in (("MS", "--stream"), ("MM", "--no-stream")):
        code, out, err = run_symalign(monkeypatch, capsys, "merge", da, db, "-o", tmp_path / name, "--scope",
                                      "model", "--max-sweeps", "3", extra)
        assert code == 0, err
    assert _same(_state(tmp_path / "MS"), _state(tmp_path / "MM"))
