"""How close the synthetic set's distribution is to the real one's.

In embedding space: ``frechet_distance``, ``knn_precision_recall`` (Kynkäänniemi et al. 2019)
and ``mauve_score`` (Pillutla et al. 2021; needs the optional extra ``fedsyn[eval]``). Over
control codes: ``allocation_error``, each code's share in one set against the other.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.logs import get_logger

log = get_logger(__name__)

MAUVE_MISSING = "MAUVE skipped: the 'mauve' package is not installed (pip install 'fedsyn[eval]')"


def _check_pair(a: np.ndarray, b: np.ndarray, min_rows: int = 2) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"need two 2-D arrays with the same width, got shapes {a.shape} and {b.shape}")
    if len(a) < min_rows or len(b) < min_rows:
        raise ValueError(f"need at least {min_rows} rows in each set, got {len(a)} and {len(b)}")
    return a, b


def frechet_distance(a_emb: np.ndarray, b_emb: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two embedding sets (as in FID).

    In: (n, d) and (m, d) arrays, n, m >= 2. Out: ``|mu_a - mu_b|^2 + tr(S_a + S_b -
    2 (S_a S_b)^(1/2))`` >= 0; 0 for identical sets. With fewer rows than dimensions
    the covariances are singular and the estimate is biased upward for small sets, so
    compare values computed from sets of similar sizes.
    """
    from scipy import linalg

    a, b = _check_pair(a_emb, b_emb)
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(cov_a @ cov_b)
    if not np.isfinite(covmean).all():
        # Singular product (few rows, many dimensions): regularise as pytorch-fid does.
        offset = np.eye(len(cov_a)) * 1e-6
        covmean = linalg.sqrtm((cov_a + offset) @ (cov_b + offset))
    # S_a S_b has real non-negative eigenvalues, so sqrtm's imaginary part is round-off.
    covmean = np.real(covmean)
    value = float(np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.trace(covmean))
    return max(value, 0.0)  # round-off makes identical sets come out at about -1e-7


def _within_any_ball(queries: np.ndarray, centres: np.ndarray, radii: np.ndarray, chunk: int = 1024) -> np.ndarray:
    from sklearn.metrics import pairwise_distances

    inside = np.zeros(len(queries), dtype=bool)
    # Distances of a query to an identical centre come out ~1e-8, not 0; the tolerance
    # keeps duplicates (radius 0) inside their own ball.
    tol = 1e-6
    for start in range(0, len(queries), chunk):  # chunks bound memory at chunk x len(centres)
        dist = pairwise_distances(queries[start:start + chunk], centres)
        inside[start:start + chunk] = (dist <= radii[None, :] + tol).any(axis=1)
    return inside


def _knn_radii(points: np.ndarray, k: int) -> np.ndarray:
    from sklearn.neighbors import NearestNeighbors

    # k + 1 neighbours because each point is its own nearest neighbour at distance 0.
    dist, _ = NearestNeighbors(n_neighbors=k + 1).fit(points).kneighbors(points)
    return dist[:, k]


def knn_precision_recall(real_emb: np.ndarray, syn_emb: np.ndarray, k: int = 5) -> tuple[float, float]:
    """Improved precision and recall (Kynkäänniemi et al., NeurIPS 2019).

    In: real (n, d) and synthetic (m, d) embeddings. Each set's manifold is the union of
    balls around its points with radius the distance to the point's k-th nearest
    neighbour in the same set. Out: ``(precision, recall)`` — precision is the share of
    synthetic points inside the real manifold (fidelity), recall the share of real points
    inside the synthetic manifold (coverage). Identical sets give (1, 1); sets far apart
    give (0, 0). ``k`` is lowered to ``size - 1`` for a set smaller than k + 1.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    real, syn = _check_pair(real_emb, syn_emb)
    k_real, k_syn = min(k, len(real) - 1), min(k, len(syn) - 1)
    precision = _within_any_ball(syn, real, _knn_radii(real, k_real)).mean()
    recall = _within_any_ball(real, syn, _knn_radii(syn, k_syn)).mean()
    return float(precision), float(recall)


class _FaissClusterWarningFilter:
    """Drop faiss's "WARNING clustering N points to K centroids" lines from stderr.

    MAUVE's own bucket heuristic (K = n/10) always triggers this C++ warning, printed
    straight to file descriptor 2. The descriptor is redirected to a temp file for the
    duration of the call and everything else captured is written back afterwards, so no
    output from other code is lost (only delayed).
    """

    def __enter__(self) -> None:
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no usable descriptor 2 (daemon): nothing to filter
            return
        self._saved = saved
        self._tmp = tempfile.TemporaryFile(mode="w+b")
        os.dup2(self._tmp.fileno(), 2)

    def __exit__(self, *exc: object) -> None:
        import sys

        if self._saved is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        captured = self._tmp.read().decode("utf-8", errors="replace")
        self._tmp.close()
        kept = [line for line in captured.splitlines(keepends=True) if not line.startswith("WARNING clustering")]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def mauve_available() -> bool:
    """Whether the optional ``mauve`` package (``pip install 'fedsyn[eval]'``) is importable."""
    from importlib.util import find_spec

    return find_spec("mauve") is not None


def mauve_score(
    real_emb: np.ndarray, syn_emb: np.ndarray, seeds: Sequence[int] = (0, 1, 2)
) -> dict[str, Any] | None:
    """MAUVE between real and synthetic embeddings, averaged over k-means seeds.

    In: real (n, d) and synthetic (m, d) embeddings, used directly as MAUVE's features
    (``mauve.compute_mauve(p_features=real, q_features=syn)``; MAUVE normalises, reduces
    with PCA and quantises them with k-means into ``max(2, min(n, m) / 10)`` buckets).
    Out: ``{"mean", "std", "per_seed", "num_buckets"}``, MAUVE in (0, 1], 1 for identical
    sets, near 0 for disjoint ones; the quantisation is random, hence several seeds.
    Returns None when the optional ``mauve`` package is not installed.
    """
    try:
        import mauve
    except ImportError:
        log.warning(MAUVE_MISSING)
        return None
    real, syn = _check_pair(real_emb, syn_emb)
    scores, buckets = [], None
    for seed in seeds:
        with _FaissClusterWarningFilter():
            out = mauve.compute_mauve(p_features=real, q_features=syn, seed=int(seed), verbose=False)
        scores.append(float(out.mauve))
        buckets = int(out.num_buckets)
    return {
        "mean": float(np.mean(scores)),
        "std": float(np.std(scores)),
        "per_seed": dict(zip((str(s) for s in seeds), scores)),
        "num_buckets": buckets,
    }


# ------------------------------------------------------------------------ allocation


def allocation_error(syn_codes: Sequence[str], real_codes: Sequence[str]) -> dict[str, Any]:
    """Each code's share in the synthetic set against its share in the real data.

    In: one code per record for each set. Out: ``{"per_code": {code: {"synthetic_share",
    "real_share", "abs_error", "synthetic_count", "real_count"}}, "total_variation",
    "max_abs_error"}`` over the union of the codes (sorted), where total variation is
    half the L1 distance between the two share vectors (0 = same proportions, 1 = no code
    in common).
    """
    if not syn_codes or not real_codes:
        raise ValueError(f"allocation error needs records in both sets, got {len(syn_codes)} and {len(real_codes)}")
    syn_counts, real_counts = Counter(map(str, syn_codes)), Counter(map(str, real_codes))
    per_code = {}
    for code in sorted(set(syn_counts) | set(real_counts)):
        s, r = syn_counts[code] / len(syn_codes), real_counts[code] / len(real_codes)
        per_code[code] = {
            "synthetic_share": s, "real_share": r, "abs_error": abs(s - r),
            "synthetic_count": syn_counts[code], "real_count": real_counts[code],
        }
    errors = [v["abs_error"] for v in per_code.values()]
    return {"per_code": per_code, "total_variation": 0.5 * float(sum(errors)), "max_abs_error": float(max(errors))}
