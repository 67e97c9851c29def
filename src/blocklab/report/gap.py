"""A claim about how a gap changes: A's advantage over B is larger at one place (`where`) than at another
(`than_where`), a difference of differences.

Each seed gives one gap per place, A - B at `where` and A - B at `than_where` (each paired by seed as any claim's
sides are); the statistic is the mean over seeds of gap(where) - gap(than_where), decided by the same two-sided
paired t-test and Holm step-down as every claim of the page (judge.py). Pairing both gaps by seed cancels what a seed
does to every setting alike (its data order), as for any paired claim.

Its direction reads as the page's other claims: for a metric better lower (a loss) the claim holds where
gap(where) - gap(than_where) < 0, A ahead of B by more at `where`; for a metric better higher, where it is > 0.

`than_where` names only keys `where` names too (the places differ in those keys and agree in every other), and
differs from `where` in at least one: `where: {model.n_layers: 12}, than_where: {model.n_layers: 2}`.

Pure functions of a claim and of numbers by pair key: judge.py builds the per-place pairs and decides."""

KEY = "than_where"


def is_gap(claim) -> bool:
    return isinstance(claim, dict) and KEY in claim


def error(claim: dict) -> str | None:
    """Why a gap claim is malformed, in one line naming the key and the fix; None where it is well formed."""
    where, versus = claim.get("where"), claim.get(KEY)
    if not isinstance(versus, dict) or not versus:
        return f"its {KEY}={str(versus)[:40]!r} is not a mapping such as {{model.n_layers: 2}}"
    if not isinstance(where, dict) or not set(versus) <= set(where):
        return (f"its {KEY} names {sorted(set(versus) - set(where or {}))}, which `where` does not; name each key "
                f"of {KEY} in `where` too (the gap at `where` is compared with the gap at {KEY})")
    if all(str(where[k]) == str(v) for k, v in versus.items()):
        return f"its {KEY} is its `where`; give {KEY} another value of at least one key"
    return None


def places(claim: dict) -> tuple[dict, dict]:
    """The two one-gap claims the gap claim compares: A against B at `where`, then at `than_where`."""
    at = {k: v for k, v in claim.items() if k != KEY}
    return at, {**at, "where": {**claim["where"], **claim[KEY]}}


def pair(at: dict, versus: dict) -> tuple[list, list[float], list[float], list]:
    """Gaps by pair key (a seed, and the compare keys the claim leaves open) at the two places -> (keys, gaps at
    `where`, gaps at `than_where`, keys one place lacks), in key order."""
    keys = [k for k in at if k in versus]
    return keys, [at[k] for k in keys], [versus[k] for k in keys], [k for k in {**at, **versus} if k not in keys]
