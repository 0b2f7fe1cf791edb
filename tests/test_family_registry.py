"""A family is one module plus one registry line: its ``model_type`` is written nowhere else under src/ or tests/.

Everything the tests, benchmarks, docs tables and experiments need about a family is declared in its module
(:mod:`symalign.families.declared`) and read through the registry (:data:`symalign.families.REGISTRY`). This
scans every Python file under ``src/`` and ``tests/`` for each registered ``model_type`` (a whole word,
case-sensitive) and allows it only in the family's own module, the registry and the family's own special-case
tests (a test file named after its module or model type, e.g. ``test_family_falcon.py``), with the named
exceptions below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from symalign.families import FAMILIES, REGISTRY

ROOT = Path(__file__).resolve().parent.parent
REGISTRY_FILE = "src/symalign/families/__init__.py"

# Families whose model type is also a user-facing value of the hf: experiment protocol (``family = "hf:gpt2"``):
# the protocol's, the CLI's and the experiments' tests and configs name them as inputs.
USER_FACING = {f.model_types[0] for f in FAMILIES if f.experiment is not None}
# Other files allowed to name a family, with the reason (a shrinking list: none for new families).
EXCEPTIONS: dict[str, dict[str, str]] = {
    "phi": {f: "the Greek letter phi in formulas" for f in (
        "src/symalign/groups/rope.py", "src/symalign/match/rope.py", "src/symalign/match/learned.py",
        "tests/test_match_rope.py")},
    "t5": {"tests/test_cli_probe.py": "T5's stacks in `probe --hf t5 --layer STACK.I` (a T5 special case)",
           "tests/test_stream_sources.py": "T5's two stacks as attention units in memory (a T5 special case)"},
    "mixtral": {"tests/test_cli_probe.py": "`probe --hf mixtral --block` (a mixture-of-experts special case)",
                "tests/test_stream_families.py": "the mixture-of-experts streamed tests (special case: experts)",
                "tests/test_device.py": "the streamed whole model on a device with experts (special case: experts)"},
    "qwen2_moe": {"tests/test_stream_families.py": "the mixture-of-experts streamed tests (special case: experts)"},
    "olmoe": {"tests/test_stream_families.py": "the mixture-of-experts streamed tests (special case: experts)"},
}
# the families the issue names (and the demonstration family): no exception may ever be added for them
STRICT = ("olmo2", "gptj", "qwen3", "phi3", "gpt_neox", "stablelm")


def _files() -> dict[str, str]:
    """Every Python file under src/ and tests/ but this one (which names the families it checks)."""
    here = Path(__file__).resolve()
    return {str(p.relative_to(ROOT)): p.read_text() for d in ("src", "tests") for p in sorted((ROOT / d).rglob("*.py"))
            if p.resolve() != here}


FILES = _files()
TYPES = [(mt, f) for f in FAMILIES for mt in f.model_types]


def naming(model_type: str) -> set[str]:
    """The files under src/ and tests/ that name ``model_type`` (a whole word)."""
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(model_type)}(?![A-Za-z0-9_])")
    return {path for path, text in FILES.items() if word.search(text)}


def allowed(model_type: str, fam) -> set[str]:
    module = type(fam).__module__.rsplit(".", 1)[-1]
    own = {f"src/symalign/families/{module}.py", REGISTRY_FILE}
    special = {p for p in FILES if p.startswith("tests/test_") and (module in p or model_type in p)}
    return own | special | set(EXCEPTIONS.get(model_type, {}))


@pytest.mark.parametrize("model_type,fam", [(mt, f) for mt, f in TYPES if mt not in USER_FACING],
                         ids=[mt for mt, _ in TYPES if mt not in USER_FACING])
def test_a_family_is_named_only_in_its_module_and_the_registry(model_type, fam):
    extra = naming(model_type) - allowed(model_type, fam)
    assert not extra, f"{model_type!r} is written in {sorted(extra)}: declare it in its family module instead"


def test_the_named_families_have_no_exception():
    assert all(mt not in EXCEPTIONS and mt not in USER_FACING for mt in STRICT)
    for mt in STRICT:
        fam = next(f for f in FAMILIES if mt in f.model_types)
        module = type(fam).__module__.rsplit(".", 1)[-1]
        assert naming(mt) <= {f"src/symalign/families/{module}.py", REGISTRY_FILE}, (mt, naming(mt))


def test_the_exceptions_are_still_needed():
    """An exception that no longer names its family is removed (the list only shrinks)."""
    for mt, files in EXCEPTIONS.items():
        assert set(files) <= naming(mt), (mt, sorted(set(files) - naming(mt)))


def test_every_registry_line_is_a_family_module():
    """Each registry line names a module under src/symalign/families/ that defines at least one family, and
    every family is defined in a registered module."""
    modules = {type(f).__module__.rsplit(".", 1)[-1] for f in FAMILIES}
    assert len(set(REGISTRY)) == len(REGISTRY) and set(REGISTRY) == modules
    assert all((ROOT / "src/symalign/families" / f"{m}.py").exists() for m in REGISTRY)
    types = [mt for f in FAMILIES for mt in f.model_types]
    assert len(types) == len(set(types))  # one family per model_type


def test_every_family_with_a_tiny_model_is_covered_by_the_generic_tests():
    """A decoder family's module declares its cases: exactness, a probe and a streamed case where streamed
    --scope model is declared (the encoders, T5 and the mixtures of experts have their own tests)."""
    from symalign.families.encoder import EncoderFamily

    for f in FAMILIES:
        if f.tiny is None or isinstance(f, EncoderFamily) or not f.cases:
            continue
        if any(c.exact for c in f.cases):
            assert any(c.probe for c in f.cases), f.family
            if "model" in f.scopes.stream:
                assert any(c.residual for c in f.cases), f.family
