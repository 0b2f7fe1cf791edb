"""Groups own their behaviour: outside ``symalign/groups/`` and ``spec.py`` no code tests a group's class.

Solvers, probes and folds ask the group (``group.is_permutation``, ``group.head_block``,
``block.block_matcher``, ``group.nearest(...)``...). This AST scan of ``src/symalign`` fails on any
``isinstance``/``issubclass`` whose class argument names a group class of the package, and on any
``type(x) is C`` / ``type(x) == C`` comparison with one (aliases from ``import ... as`` included).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
import pytest

import symalign
import symalign.groups
from symalign.groups import Group

SRC = Path(symalign.__file__).parent
ALLOWED = {SRC / "spec.py"}


def group_class_names() -> set[str]:
    """Every class defined in the groups package that is a :class:`Group` (private ones included)."""
    names = set()
    for info in pkgutil.iter_modules(symalign.groups.__path__, "symalign.groups."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, Group) and obj.__module__.startswith("symalign.groups"):
                names.add(name)
    return names


def _names(node: ast.AST) -> set[str]:
    """The names a class argument refers to: ``C``, ``mod.C`` (as ``C``), and each of a tuple's items."""
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
    return out


def class_tests(source: str, classes: set[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of every class test on a group class in ``source``."""
    tree = ast.parse(source)
    local = set(classes)
    for node in ast.walk(tree):  # from symalign.groups[.x] import C as D: D names a group class too
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("symalign.groups"):
            local |= {a.asname for a in node.names if a.name in classes and a.asname}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                            "issubclass"):
            if len(node.args) == 2 and _names(node.args[1]) & local:
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.Eq, ast.NotEq))
                                                   for op in node.ops):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type"
                        for s in sides)
            if typed and any(isinstance(s, (ast.Name, ast.Attribute)) and _names(s) & local for s in sides):
                hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_the_scan_knows_the_group_classes():
    names = group_class_names()
    assert {"Permutation", "PositiveMonomial", "PerHead", "OffsetPerHead", "RotaryPlanes", "PlaneSigns",
            "PlaneIdentity", "PlaneScales", "SignedPermutations", "FixingOrthogonal", "BlockPermutations",
            "HeadPermutation", "GeneralLinear", "Orthogonal", "MatrixGroup", "Group"} <= names


def test_the_scan_finds_class_tests():
    """The scan has teeth: each form of a class test on a group class is reported, other code is not."""
    src = """
from symalign.groups import PerHead as PH, RotaryPlanes
import symalign.groups as G
a = isinstance(g, PH)
b = isinstance(g.inner, (RotaryPlanes, int))
c = type(g) is G.Permutation
d = issubclass(type(g), G.PlaneSigns)
e = type(g) == RotaryPlanes
ok = isinstance(g, int) or g.head_block is not None or type(g) is dict
"""
    hits = class_tests(src, group_class_names())
    assert [line for line, _ in hits] == [4, 5, 6, 7, 8]


@pytest.mark.slow
def test_no_class_test_on_a_group_outside_the_groups_package_and_spec():
    classes = group_class_names()
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "groups") in path.parents or path in ALLOWED:
            continue
        found += [f"{path.relative_to(SRC)}:{line}: {code}" for line, code in class_tests(path.read_text(), classes)]
    assert not found, ("ask the group (a property or method it owns), not its class:\n" + "\n".join(found))


def test_what_a_group_states_about_itself():
    """The properties callers ask instead of the class, on each kind."""
    from symalign.groups import (BlockPermutations, CenteredOrthogonal, GeneralLinear, HeadPermutation,
                                 OffsetPerHead, Orthogonal, PerHead, Permutation, PositiveMonomial, RotaryPlanes)

    flags = ("is_permutation", "scales_units", "permutes_heads", "permutes_within_blocks")
    kinds = {Permutation(4): "is_permutation", PositiveMonomial(4): "scales_units",
             HeadPermutation(4, 2, 2): "permutes_heads", BlockPermutations(3, 4): "permutes_within_blocks",
             Orthogonal(4): None, GeneralLinear(4): None, PerHead(GeneralLinear(2), 2): None}
    for g, flag in kinds.items():
        assert [f for f in flags if getattr(g, f)] == ([flag] if flag else []), g.describe()
    block = RotaryPlanes(6, "half", 4)
    assert PerHead(block, 3).head_block is block and OffsetPerHead(block, 3, offset=1.0).head_block is block
    assert all(g.head_block is None for g in kinds if not isinstance(g, PerHead))
    assert Orthogonal(5).free_dims == 5 and CenteredOrthogonal(5).free_dims == 4


def test_block_groups_state_their_matcher_relaxation_and_bias_shifts():
    """Each exact-step group is a subgroup of its relaxation, which the two-stage matcher solves; the key-bias
    shift is the unrotated width where the bias meets the scores unnormalised."""
    from symalign.groups import GeneralLinear, PlaneIdentity, PlaneScales, PlaneSigns, RotaryPlanes, \
        SignedPermutations

    assert GeneralLinear(4).block_matcher == "gl" and RotaryPlanes(4).block_matcher == "rope"
    for g in (PlaneSigns(6, "half", 4), PlaneSigns(6, "interleaved"), PlaneSigns(6, "half", 2, proportional=True),
              PlaneIdentity(4, "half", 0), PlaneScales(6, "half", 4), SignedPermutations(5)):
        wide = g.relaxation()
        assert g.block_matcher in ("signs", "identity", "scales", "signed-permutations")
        assert wide.block_matcher in ("gl", "rope") and wide.n == g.n
        for seed in range(3):
            assert wide.contains(g.sample(seed)), (g.describe(), wide.describe())
    assert PlaneSigns(6, "half", 2, proportional=True).relaxation() == GeneralLinear(6)
    assert PlaneSigns(6, "half", 4).relaxation() == RotaryPlanes(6, "half", 4)
    shifts = {GeneralLinear(4): 4, RotaryPlanes(6, "half", 4): 2, RotaryPlanes(4): 0, PlaneSigns(6, "half", 4): 0,
              PlaneIdentity(4, "half", 0): 0, PlaneScales(6, "half", 4): 2, SignedPermutations(3): 0}
    assert {g: g.key_bias_shift for g in shifts} == shifts
    assert [g.centring for g in shifts] == [False, False, False, False, True, False, False]
    assert [g.rescales_gains for g in shifts] == [False, False, False, False, False, True, False]
