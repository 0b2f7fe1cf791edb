"""symalign: align Transformers through their exact parameter symmetries.

Core objects:

* :mod:`symalign.groups` -- the groups (permutations, O, GL, the RoPE plane group H,
  head permutations with GQA, per-head products) and their exact actions;
* :mod:`symalign.spec` -- :class:`SymmetrySpec`, transforms, :func:`apply`;
* :mod:`symalign.nn` -- the reference attention layer with every positional encoding;
* :mod:`symalign.probe` -- measure a module's symmetry group (``symalign.probe.probe(module, inputs)``);
* :func:`symalign.trace` -- the exact spec of any module built from standard layers (:mod:`symalign.tracing`).
"""

from symalign.errors import SymalignError
from symalign.spec import AxisAction, SymmetrySpec, Transform, apply, compose, invert

__version__ = "0.1.0"

__all__ = ["SymalignError", "SymmetrySpec", "AxisAction", "Transform", "apply", "compose", "invert", "__version__"]


def __getattr__(name):  # lazy: heavy subpackages load on first use
    if name == "probe":  # the module symalign.probe (its function is symalign.probe.probe)
        import importlib

        return importlib.import_module("symalign.probe")
    if name == "match_attention":
        from symalign.match import match_attention

        return match_attention
    if name in ("trace", "TraceResult"):  # the package is symalign.tracing, so nothing is shadowed
        from symalign import tracing

        return getattr(tracing, name)
    raise AttributeError(f"module 'symalign' has no attribute {name!r}")
