"""Reading an einsum equation's letters (analysis/sharding/rules.py's einsum rule and the
one-head parts of analysis/sharding/one_head.py)."""
from __future__ import annotations


def einsum_letters(eq: str, ranks: list):
    """Each operand's letters and the output's of an explicit or implicit einsum equation,
    an ellipsis spelled as fresh letters right-aligned across the operands (numpy's
    broadcasting of the ``...`` dims); None when it cannot be read."""
    eq = eq.replace(" ", "")
    ins, arrow, out = eq.partition("->")
    parts = ins.split(",")
    if len(parts) != len(ranks):
        return None
    fresh = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    ell = max([r - (len(p) - 3) for p, r in zip(parts, ranks) if "..." in p], default=0)
    if ell > len(fresh) or ell < 0:
        return None
    fill = fresh[:ell]
    spelled = []
    for p, r in zip(parts, ranks):
        if "..." in p:
            n = r - (len(p) - 3)
            if n < 0 or p.count("...") != 1:
                return None
            p = p.replace("...", "".join(fill[ell - n:]))
        if len(p) != r or not p.isalpha():
            return None
        spelled.append(p)
    if not arrow:  # implicit output: the ellipsis, then the letters seen once, sorted
        letters = "".join(spelled)
        out = "".join(fill) + "".join(sorted(c for c in set(letters) if letters.count(c) == 1
                                             and c not in fill))
    else:
        if "..." in out:
            out = out.replace("...", "".join(fill))
        if not out.isalpha() and out:
            return None
    return spelled, out
