"""Shared pieces of the tracer's graph walk: node values, names and the opaque signal."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import Tensor

from symalign.tracing.labels import Labels

LOW = {torch.float32, torch.float16, torch.bfloat16}  # casts below float64 limit what the check resolves


@dataclass
class Val:
    labels: Labels | None  # None: opaque
    roots: frozenset = frozenset()  # for opaque values: the recognised values they came from
    opq: frozenset = frozenset()  # opaque nodes on the way
    const: bool = False  # a buffer / constant (or computed only from them)


def op_name(node) -> str:
    t = node.target
    if t is operator.getitem:
        return "getitem"
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def layer_of(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values()]
    return paths[-1] if paths and paths[-1] else "(model)"


def shape_of(node) -> tuple | None:
    v = node.meta.get("val")
    return tuple(v.shape) if isinstance(v, Tensor) else None


class Opaque(Exception):
    """Raised by an operation rule: the operation is not recognised on these labels."""


def flat(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from flat(y)
    else:
        yield x


def tensor_args(node):
    return [a for a in flat((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]

