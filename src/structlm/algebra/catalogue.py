"""The algebra catalogue: graph algebras, ``Q_q``, tensor products, and names.

Name grammar (used by the CLI and configs)::

    Q<q>                 complete-graph algebra Q_q (Q1 is the field: a dense layer)
    Q<q>^<L>             tensor power, e.g. Q2^2 = Q_2 ⊗ Q_2
    graph:<n>:<edges>    graph algebra on n vertices, edges "a-b" (directed a -> b),
                         comma separated, e.g. graph:3:0-1,1-2,2-0
    A x B  or  A ⊗ B     tensor product of two names, e.g. Q2xQ4
    dense                alias of Q1
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from structlm.algebra.structure import Algebra, AlgebraError

__all__ = [
    "CATALOGUE_NAMES",
    "complete_graph_algebra",
    "get_algebra",
    "graph_algebra",
    "is_dense",
    "num_types",
    "tensor_power",
    "tensor_product",
]

#: Names shown by ``structlm algebra table``.
CATALOGUE_NAMES = ("Q2", "Q4", "Q2^2", "Q8", "Q2^3", "Q16", "Q32", "graph:3:0-1,1-2,2-0")


def graph_algebra(
    num_vertices: int, edges: Sequence[tuple[int, int]], name: str | None = None
) -> Algebra:
    """Graph algebra ``Q_G``: basis ``e_i`` per vertex and ``a_ij`` per edge.

    Non-zero products: ``e_i e_i = e_i``, ``e_i a_ij = a_ij``, ``a_ij e_j = a_ij``.
    Basis element ``e_i`` sits at cell ``(i, i)`` and ``a_ij`` at cell ``(i, j)``.

    Raises:
        AlgebraError: on a self-loop, a repeated edge or a vertex out of range.
    """
    if num_vertices < 1:
        raise AlgebraError(f"a graph needs at least one vertex, got {num_vertices}")
    if num_vertices > MAX_Q:
        raise AlgebraError(f"a graph algebra of {num_vertices:,} vertices is over the "
                           f"{MAX_Q} this builds: its position types (q = vertices) index "
                           f"q x q weight blocks, and its facts take memory growing with "
                           f"q^3 ({num_vertices:,}^3 = {num_vertices ** 3:,})")
    seen: set[tuple[int, int]] = set()
    for a, b in edges:
        if not (0 <= a < num_vertices and 0 <= b < num_vertices):
            raise AlgebraError(
                f"edge {a}-{b} names a vertex outside [0, {num_vertices})"
            )
        if a == b:
            raise AlgebraError(
                f"self-loop {a}-{b}: graph algebras are defined for graphs without "
                "self-loops (the vertex idempotent e_i already plays that role)"
            )
        if (a, b) in seen:
            raise AlgebraError(f"edge {a}-{b} is listed twice")
        seen.add((a, b))
    n = num_vertices
    names = [f"e{i}" for i in range(n)] + [f"a{a}{b}" if n <= 10 else f"a{a}_{b}" for a, b in edges]
    cells = [(i, i) for i in range(n)] + [tuple(e) for e in edges]
    entries = [(i, i, i) for i in range(n)]
    for m, (a, b) in enumerate(edges):
        edge = n + m
        entries.append((a, edge, edge))  # e_a a_ab = a_ab
        entries.append((edge, b, edge))  # a_ab e_b = a_ab
    edge_txt = ",".join(f"{a}-{b}" for a, b in edges)
    return Algebra(
        name or f"graph:{n}:{edge_txt}",
        n + len(edges),
        np.array(entries, dtype=np.int64),
        np.ones(len(entries)),
        names,
        np.array(cells, dtype=np.int64),
        n,
    )


def complete_graph_algebra(q: int) -> Algebra:
    """``Q_q``: the graph algebra of the complete directed graph on ``q`` vertices."""
    if q < 1:
        raise AlgebraError(f"Q_q needs q >= 1, got {q}")
    edges = [(a, b) for a in range(q) for b in range(q) if a != b]
    return graph_algebra(q, edges, name=f"Q{q}")


def tensor_product(a: Algebra, b: Algebra, name: str | None = None) -> Algebra:
    """``A ⊗ B``: structure tensor is the Kronecker product; cells are pairs.

    Basis element ``(i, j)`` has index ``i * dim B + j``; grid cell
    ``((r_a, r_b), (c_a, c_b))`` becomes ``(r_a q_B + r_b, c_a q_B + c_b)``, so group
    and type indices are mixed-radix numbers (for ``Q2^2``: 2-bit strings).
    """
    if a.nnz * b.nnz > MAX_PRODUCT_NNZ:
        raise AlgebraError(f"{name or a.name + 'x' + b.name}: the tensor product would hold "
                           f"{a.nnz * b.nnz:,} structure constants, over the "
                           f"{MAX_PRODUCT_NNZ:,} this builds in memory (Q2^6 has 46,656)")
    db = b.dim
    ea = np.repeat(a.entries, b.nnz, axis=0)
    eb = np.tile(b.entries, (a.nnz, 1))
    entries = ea * db + eb
    values = np.repeat(a.values, b.nnz) * np.tile(b.values, a.nnz)
    names = [f"{x}⊗{y}" for x in a.basis_names for y in b.basis_names]
    cells = q = None
    if a.cells is not None and b.cells is not None:
        assert a.q is not None and b.q is not None
        q = a.q * b.q
        ca = np.repeat(a.cells, db, axis=0)
        cb = np.tile(b.cells, (a.dim, 1))
        cells = ca * b.q + cb
    return Algebra(name or f"{a.name}x{b.name}", a.dim * db, entries, values, names, cells, q)


def tensor_power(a: Algebra, power: int, name: str | None = None) -> Algebra:
    """``A^{⊗L}`` for ``L >= 1``."""
    if power < 1:
        raise AlgebraError(f"tensor power must be >= 1, got {power}")
    out = a
    for _ in range(power - 1):
        out = tensor_product(out, a)
    out.name = name or (a.name if power == 1 else f"{a.name}^{power}")
    return out


MAX_Q = 256
"""Largest ``q`` of ``Q<q>`` (``q^2`` basis elements; ``structlm algebra info Q256`` peaks
at about 1 GB)."""
MAX_PRODUCT_NNZ = 262_144
"""Most structure constants of a tensor product built: its facts (associativity,
radical) take time and memory growing faster than its constants (Q2^6, 46,656 of them:
~17 s and 0.7 GB on 2 cores; Q2^8 ran out of 6 GB)."""

_GRAPH_RE = re.compile(r"^graph:(\d+):(.*)$")
_Q_RE = re.compile(r"^Q(\d+)(?:\^(\d+))?$")


def is_dense(name: str) -> bool:
    """Whether an FFN algebra name means a plain dense layer (``dense`` or ``Q1``)."""
    return name.strip().lower() in ("dense", "q1")


def num_types(name: str) -> int:
    """Position types (``q``) of an FFN algebra name: 1 for dense."""
    return 1 if is_dense(name) else int(get_algebra(name).q or 1)


@lru_cache(maxsize=64)
def get_algebra(name: str) -> Algebra:
    """Build an algebra from its name (see the module docstring for the grammar).

    Raises:
        AlgebraError: for a name that does not parse, naming it and the grammar.
    """
    if not isinstance(name, str):
        raise AlgebraError(f"algebra name must be a string, got {type(name).__name__}")
    text = name.strip()
    if text.lower() == "dense":
        return complete_graph_algebra(1)
    if not text.startswith("graph:"):
        parts = re.split(r"\s*(?:⊗|x|\*)\s*", text)
        if len(parts) > 1:
            if not all(parts):
                raise AlgebraError(
                    f"unknown algebra name {name!r}: a tensor product 'A x B' needs a "
                    "factor on both sides of each 'x'"
                )
            out = get_algebra(parts[0])
            for p in parts[1:]:
                out = tensor_product(out, get_algebra(p))
            out.name = text
            return out
    m = _Q_RE.match(text)
    if m:
        q = int(m.group(1))
        if q < 1 or q > MAX_Q:
            raise AlgebraError(f"Q<q> needs 1 <= q <= {MAX_Q}, got q={q} in {name!r}: it "
                               f"has q^2 = {q * q:,} basis elements, and its facts take "
                               "memory growing with their square (Q256: about 1 GB; the "
                               "paper's largest is q = 256)")
        base = complete_graph_algebra(q)
        if m.group(2) is None:
            return base
        power = int(m.group(2))
        if power < 1:
            raise AlgebraError(f"{text}: a tensor power Q<q>^<L> needs L >= 1, got L={power}")
        if base.nnz ** power > MAX_PRODUCT_NNZ:
            raise AlgebraError(f"{text}: the tensor power would hold {base.nnz ** power:,} "
                               f"structure constants, over the {MAX_PRODUCT_NNZ:,} this builds "
                               "in memory (Q2^6 has 46,656)")
        return tensor_power(base, power, name=text)
    m = _GRAPH_RE.match(text)
    if m:
        n = int(m.group(1))
        edges: list[tuple[int, int]] = []
        body = m.group(2).strip()
        if body:
            for tok in body.split(","):
                em = re.match(r"^\s*(\d+)\s*-\s*(\d+)\s*$", tok)
                if not em:
                    raise AlgebraError(
                        f"bad edge {tok!r} in {name!r}: expected 'a-b' with vertex numbers"
                    )
                edges.append((int(em.group(1)), int(em.group(2))))
        return graph_algebra(n, edges, name=text)
    raise AlgebraError(
        f"unknown algebra name {name!r}: expected 'Q<q>' (e.g. Q4), 'Q<q>^<L>' "
        "(e.g. Q2^2), 'graph:<n>:<a-b,...>' (e.g. graph:3:0-1,1-2), 'A x B' or 'dense'"
    )
