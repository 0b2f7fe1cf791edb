"""Data-free two-stage weight matching of attention layers (the ICML 2026 paper's two-stage matcher).

* :func:`match_attention` / :func:`align_models` -- the matcher;
* :mod:`~symalign.match.views` -- canonical per-head views read from a spec;
* :mod:`~symalign.match.heads` -- stage 1 (head assignment) and its metrics;
* :mod:`~symalign.match.qk` (Q-K and V-O), :mod:`~symalign.match.rope` -- stage 2.
"""

from symalign.match.api import AttentionMatch, LayerMatch, align_models, match_attention
from symalign.match.heads import lhat, permutation_rank

__all__ = ["match_attention", "align_models", "AttentionMatch", "LayerMatch", "permutation_rank", "lhat"]
