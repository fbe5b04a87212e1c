"""Dense Hessian and exact eigenvalues for small models (paper §4.1).

The Hessian is assembled column block by column block with ``HessianOperator.matmat``
(c Hessian-vector products vectorised with ``pfor``), symmetrised as (H + Hᵀ)/2 and
diagonalised by ``numpy.linalg.eigh`` in float64. Memory is p² float64 values
(3,000 parameters: 72 MB), time p HVPs.
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.spectrum.lanczos import _progress


def dense_hessian(operator, *, chunk_size: int = 64, verbose: bool = False, return_asymmetry: bool = False):
    """The (p, p) float64 Hessian of ``operator`` (a ``HessianOperator``), symmetrised.

    Args:
      operator: object with ``dimension`` and ``matmat(V)`` (or only ``matvec``).
      chunk_size: columns per vectorised block (memory ∝ chunk_size × activations).
      verbose: progress bar.
      return_asymmetry: also return the relative asymmetry of the assembled matrix.

    Returns:
      H (p, p) float64, exactly symmetric: (H_raw + H_rawᵀ)/2 of the matrix assembled
      from the Hessian-vector products. With ``return_asymmetry=True`` the pair
      ``(H, asymmetry)``, ``asymmetry = max|H_raw − H_rawᵀ| / max|H_raw|`` (a float;
      round-off of the products, ≈1e-16 for a float64 model).
    """
    p = int(operator.dimension)
    chunk = check_int("chunk_size", chunk_size, minimum=1)
    H = np.zeros((p, p))
    bar = _progress(p, verbose, "dense Hessian")
    use_matmat = hasattr(operator, "matmat")
    for start in range(0, p, chunk):
        stop = min(p, start + chunk)
        E = np.zeros((p, stop - start))
        E[np.arange(start, stop), np.arange(stop - start)] = 1.0
        if use_matmat:
            H[:, start:stop] = operator.matmat(E)
        else:
            for j in range(stop - start):
                H[:, start + j] = operator.matvec(E[:, j])
        if bar is not None:
            bar.update(stop - start)
    if bar is not None:
        bar.close()
    symmetric = 0.5 * (H + H.T)
    if not return_asymmetry:
        return symmetric
    scale = max(float(np.max(np.abs(H))), 1e-300)
    return symmetric, float(np.max(np.abs(H - H.T)) / scale)


def exact_eigenvalues(hessian) -> np.ndarray:
    """All eigenvalues of a symmetric (p, p) matrix, descending (``numpy.linalg.eigh``, float64)."""
    H = np.asarray(hessian, dtype=np.float64)
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"hessian must be a square matrix, got shape {H.shape}.")
    return np.linalg.eigvalsh(0.5 * (H + H.T))[::-1]
