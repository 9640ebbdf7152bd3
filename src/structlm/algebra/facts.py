"""Facts of an algebra as ``structlm algebra info`` reports them, and the seed's table."""

from __future__ import annotations

from collections.abc import Sequence

from structlm.algebra.catalogue import CATALOGUE_NAMES, get_algebra
from structlm.algebra.structure import AlgebraError
from structlm.algebra.support import support_of

__all__ = ["algebra_facts", "algebra_table_markdown"]


def algebra_facts(name: str) -> dict[str, object]:
    """Every fact ``structlm algebra info`` reports, computed from the tensor."""
    a = get_algebra(name)
    rank = a.rank
    facts: dict[str, object] = {
        "name": a.name,
        "dim": a.dim,
        "t": a.num_maximal_ideals,
        "rank_lower_bound": rank.lower_bound,
        "explicit_products": rank.explicit_products,
        "exact_rank": rank.exact,
        "rank_interval": list(rank.interval),
        "associative": a.is_associative,
        "has_unit": a.has_unit,
        "radical_dim": a.radical_dim,
        "q": a.q,
    }
    if a.unit is not None:
        facts["unit"] = [a.basis_names[i] for i, v in enumerate(a.unit) if v != 0] if all(
            v in (0.0, 1.0) for v in a.unit) else [float(v) for v in a.unit]
    try:
        s = support_of(a)
    except AlgebraError as err:
        facts["mac_ratio"] = None
        facts["layer_error"] = str(err)
    else:
        facts["mac_ratio"] = str(s.mac_ratio())
        facts["layer_triples"] = s.num_triples
        facts["dead_blocks"] = int((~s.used_blocks).sum())
    return facts


def _rank_text(f: dict[str, object]) -> str:
    if f["exact_rank"] is not None:
        return str(f["exact_rank"])
    lo, hi = f["rank_interval"]  # type: ignore[misc]
    return f"only known in [{lo}, {hi}]" if lo is not None else f"<= {hi} (t unknown)"


def algebra_table_markdown(names: Sequence[str] = CATALOGUE_NAMES) -> str:
    """The seed's table (SPEC §A.2) for the catalogue, as Markdown."""
    lines = [
        "| algebra | q | slots (dim) | t | block products of explicit algorithm | "
        "layer triples | equal-width MAC ratio | exact rank |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in names:
        f = algebra_facts(n)
        lines.append(
            f"| {f['name']} | {f['q']} | {f['dim']} | {f['t']} | {f['explicit_products']} | "
            f"{f.get('layer_triples', '-')} | {f['mac_ratio']} | {_rank_text(f)} |")
    return "\n".join(lines) + "\n"
