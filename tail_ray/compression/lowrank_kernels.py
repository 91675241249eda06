"""The low-rank path's linear algebra in a fixed order of operations: the same bits on every CPU.

Through torch, a power step's products and QR and the chooser's small eigendecomposition ran
in BLAS / LAPACK, whose kernels the CPU picks (AVX-512 or AVX2 blocking, FMA or not): the
factors a rank sent, and so which layers its chooser wanted low-rank, could differ between
two machines given the same M. Every receiver decoded the same bytes (``reconstruct`` was
already fixed-order), so replicas stayed equal, but a run was not the same run on another
CPU, as the quantized path is (docs/engine.md, "The grid, and the same bits on every CPU").

Here every sum runs over one index in one order, each product of two float32 values is
exact in float64 and is added in float64, and nothing is compiled with fastmath (so LLVM
neither reassociates a sum across vector lanes nor fuses a multiply-add): the loops
vectorize across independent outputs only. The orthonormalization is modified Gram-Schmidt
and the eigendecomposition cyclic Jacobi, both in float64 with only +, -, *, / and sqrt
(IEEE-exact everywhere). tests/compression/isa_digest.py hashes their outputs under other
numba CPU targets.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Jacobi sweeps: a symmetric R x R matrix (R <= 16 here) converges in well under 20.
_JACOBI_MAX_SWEEPS = 50


@njit(cache=True, nogil=True)
def _project(m, q, out):  # type: ignore[no-untyped-def]
    """out (rows x r) = m (rows x cols, float32) @ q (cols x r, float32); per output
    a float64 sum over j in order. Four rows at a time share each loaded row of q."""
    rows, cols = m.shape
    r = q.shape[1]
    acc = np.empty((4, r), dtype=np.float64)
    for i0 in range(0, rows, 4):
        n = min(4, rows - i0)
        for k in range(4):
            for c in range(r):
                acc[k, c] = 0.0
        if n == 4:
            for j in range(cols):
                m0 = np.float64(m[i0, j])
                m1 = np.float64(m[i0 + 1, j])
                m2 = np.float64(m[i0 + 2, j])
                m3 = np.float64(m[i0 + 3, j])
                for c in range(r):
                    qc = np.float64(q[j, c])
                    acc[0, c] += m0 * qc
                    acc[1, c] += m1 * qc
                    acc[2, c] += m2 * qc
                    acc[3, c] += m3 * qc
        else:
            for k in range(n):
                for j in range(cols):
                    mij = np.float64(m[i0 + k, j])
                    for c in range(r):
                        acc[k, c] += mij * np.float64(q[j, c])
        for k in range(n):
            for c in range(r):
                out[i0 + k, c] = np.float32(acc[k, c])


@njit(cache=True, nogil=True)
def _project_t(m, p, out):  # type: ignore[no-untyped-def]
    """out (cols x r) = m^T @ p (p: rows x r, float64); per output a float64 sum over i in order.
    Four rows of m at a time: each output takes their four terms one after another in a
    register (the same additions in the same order as one row at a time), so the running
    sums are loaded and stored a quarter as often."""
    rows, cols = m.shape
    r = p.shape[1]
    acc = np.zeros((cols, r), dtype=np.float64)
    full = rows - rows % 4
    for i in range(0, full, 4):
        for j in range(cols):
            m0 = np.float64(m[i, j])
            m1 = np.float64(m[i + 1, j])
            m2 = np.float64(m[i + 2, j])
            m3 = np.float64(m[i + 3, j])
            for c in range(r):
                a = acc[j, c]
                a += m0 * p[i, c]
                a += m1 * p[i + 1, c]
                a += m2 * p[i + 2, c]
                a += m3 * p[i + 3, c]
                acc[j, c] = a
    for i in range(full, rows):
        for j in range(cols):
            mij = np.float64(m[i, j])
            for c in range(r):
                acc[j, c] += mij * p[i, c]
    for j in range(cols):
        for c in range(r):
            out[j, c] = np.float32(acc[j, c])


@njit(cache=True, nogil=True)
def _orthonormalize(a):  # type: ignore[no-untyped-def]
    """Modified Gram-Schmidt on the columns of a (rows x r, float32) in float64, returned as
    a new float64 array (rows x r). A column that vanishes against the ones before it (a zero
    gradient, a rank above M's) becomes zero: its Q column is then zero and sends nothing.

    Column c is projected off columns 0, 1, ..., c-1 in turn (each final, normalized), then
    normalized: the classic order, so every entry sees the same operations in the same order
    as column after column. Run as: each finished column is taken off all the later ones, on
    a transposed copy (r x rows, every column contiguous), four later columns at a time, so
    four dot products' chains of additions run side by side instead of one after another."""
    rows, r = a.shape
    # Rows padded by one cache line: at a power-of-two length the columns would sit 4 KiB
    # apart, in the same L1 sets, and evict one another in the four-column loops.
    pt = np.empty((r, rows + 8), dtype=np.float64)
    for i in range(rows):
        for c in range(r):
            pt[c, i] = np.float64(a[i, c])
    norm0 = np.zeros(r, dtype=np.float64)
    for c in range(r):
        col = pt[c]
        s = 0.0
        for i in range(rows):
            s += col[i] * col[i]
        norm0[c] = s
    for k in range(r):
        pk = pt[k]
        norm = 0.0
        for i in range(rows):
            norm += pk[i] * pk[i]
        # Left with under ~1e-12 of its own energy, the column is numerically in the span of
        # the ones before it: a direction of rounding noise, not of M.
        if norm > 0.0 and norm > 1e-24 * norm0[k]:
            inv = 1.0 / np.sqrt(norm)
            for i in range(rows):
                pk[i] *= inv
        else:
            for i in range(rows):
                pk[i] = 0.0
        c = k + 1
        while c + 4 <= r:
            c0, c1, c2, c3 = pt[c], pt[c + 1], pt[c + 2], pt[c + 3]
            d0 = d1 = d2 = d3 = 0.0
            for i in range(rows):
                x = pk[i]
                d0 += x * c0[i]
                d1 += x * c1[i]
                d2 += x * c2[i]
                d3 += x * c3[i]
            for i in range(rows):
                x = pk[i]
                c0[i] -= d0 * x
                c1[i] -= d1 * x
                c2[i] -= d2 * x
                c3[i] -= d3 * x
            c += 4
        while c < r:
            cc = pt[c]
            d = 0.0
            for i in range(rows):
                d += pk[i] * cc[i]
            for i in range(rows):
                cc[i] -= d * pk[i]
            c += 1
    p = np.empty((rows, r), dtype=np.float64)
    for i in range(rows):
        for c in range(r):
            p[i, c] = pt[c, i]
    return p


def power_step_arrays(m: np.ndarray, q_warm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One power iteration of ``m`` (rows x cols, float32) from ``q_warm`` (cols x r,
    float32): (P, Q), P orthonormal (rows x r, float32; zero columns where M Q_warm has no
    new direction), Q = M^T P (cols x r, float32, from P in float64)."""
    m = np.ascontiguousarray(m, dtype=np.float32)
    q_warm = np.ascontiguousarray(q_warm, dtype=np.float32)
    rows, cols = m.shape
    r = q_warm.shape[1]
    mq = np.empty((rows, r), dtype=np.float32)
    _project(m, q_warm, mq)
    p64 = _orthonormalize(mq)
    q = np.empty((cols, r), dtype=np.float32)
    _project_t(m, p64, q)
    return p64.astype(np.float32), q


@njit(cache=True, nogil=True)
def _gram(q):  # type: ignore[no-untyped-def]
    """Q^T Q (r x r, float64), each entry a sum over the rows in order."""
    cols, r = q.shape
    g = np.zeros((r, r), dtype=np.float64)
    for j in range(cols):
        for a in range(r):
            qa = np.float64(q[j, a])
            for b in range(r):
                g[a, b] += qa * np.float64(q[j, b])
    return g


@njit(cache=True, nogil=True)
def _jacobi_eigh(a, max_sweeps):  # type: ignore[no-untyped-def]
    """Eigenvalues and eigenvectors (columns) of the symmetric float64 matrix ``a`` by cyclic
    Jacobi rotations, pairs (p, q) in row order, until no off-diagonal entry is above 1e-15 of
    the diagonal's scale or ``max_sweeps`` sweeps."""
    n = a.shape[0]
    a = a.copy()
    v = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        v[i, i] = 1.0
    for _sweep in range(max_sweeps):
        off = 0.0
        scale = 0.0
        for i in range(n):
            scale += a[i, i] * a[i, i]
            for j in range(i + 1, n):
                off += a[i, j] * a[i, j]
        if off <= 1e-30 * scale or off == 0.0:
            break
        for p in range(n - 1):
            for q in range(p + 1, n):
                apq = a[p, q]
                if apq == 0.0:
                    continue
                theta = (a[q, q] - a[p, p]) / (2.0 * apq)
                t = 1.0 / (abs(theta) + np.sqrt(theta * theta + 1.0))
                if theta < 0.0:
                    t = -t
                c = 1.0 / np.sqrt(t * t + 1.0)
                s = t * c
                for k in range(n):
                    akp = a[k, p]
                    akq = a[k, q]
                    a[k, p] = c * akp - s * akq
                    a[k, q] = s * akp + c * akq
                for k in range(n):
                    apk = a[p, k]
                    aqk = a[q, k]
                    a[p, k] = c * apk - s * aqk
                    a[q, k] = s * apk + c * aqk
                for k in range(n):
                    vkp = v[k, p]
                    vkq = v[k, q]
                    v[k, p] = c * vkp - s * vkq
                    v[k, q] = s * vkp + c * vkq
    values = np.empty(n, dtype=np.float64)
    for i in range(n):
        values[i] = a[i, i]
    return values, v


@njit(cache=True, nogil=True)
def _rotate(q, vectors, out):  # type: ignore[no-untyped-def]
    """out (cols x r) = q (cols x r, float32) @ vectors (r x r, float64), sums over r in order
    (a row's r sums run side by side: each is still its own chain over k = 0, 1, ...)."""
    cols, r = q.shape
    acc = np.empty(r, dtype=np.float64)
    for j in range(cols):
        for c in range(r):
            acc[c] = 0.0
        for k in range(r):
            qjk = np.float64(q[j, k])
            for c in range(r):
                acc[c] += qjk * vectors[k, c]
        for c in range(r):
            out[j, c] = np.float32(acc[c])


def captured_energy_arrays(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For Q = M^T P (cols x R, float32): the cumulative energy the best rank-r approximation
    inside span(P) keeps, r = 1..R (float64, descending eigenvalues of Q^T Q, clipped at 0),
    and those directions (cols x R, float32, best first)."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    values, vectors = _jacobi_eigh(_gram(q), _JACOBI_MAX_SWEEPS)
    order = np.argsort(-values, kind="stable")  # descending; ties keep Jacobi's order
    captured = np.cumsum(np.clip(values[order], 0.0, None))
    basis = np.empty(q.shape, dtype=np.float32)
    _rotate(q, np.ascontiguousarray(vectors[:, order]), basis)
    return captured, basis
