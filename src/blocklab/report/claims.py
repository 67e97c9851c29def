"""A sweep's registered claims, fingerprinted: a page whose claims were edited after its runs were measured says so.

A claim's fingerprint covers what it tests (its sentence, metric, sides, `where`, `than_where`, `min_effect`), not
how the page words its context (`paper`, `paper_scale`, `paper_tested`, `why`, `figure`). Each run's saved config holds
study.verdict as it was when the run trained, so the fingerprint at measurement time is read from the runs, old ones
included."""
import hashlib
import json

TESTED = ("claim", "metric", "better", "than", "where", "min_effect")
LATER = ("than_where",)  # a gap claim's second place (gap.py)


def claims_hash(verdict) -> str | None:
    """12 hex digits of the SHA-256 of the claims' tested keys (study.verdict and each of its `also`), or None
    where no claim is registered."""
    if not isinstance(verdict, dict):
        return None
    registered = [verdict, *(verdict.get("also") or [])]
    # A key added later joins the fingerprint only where a claim states it, so older claims keep theirs
    tested = [{**{k: c.get(k) for k in TESTED}, **{k: c[k] for k in LATER if k in c}} if isinstance(c, dict) else c
              for c in registered]
    text = json.dumps(tested, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def claims_changed(meta: dict, jobs: list[dict]) -> dict:
    """Whether the page's claims (the sweep file's now: meta's study.verdict) differ from those its runs were
    measured under (each job's `claims`): {"now", "measured": {hash: jobs}, "changed": jobs measured under other
    claims, "unrecorded": jobs from before the fingerprint was kept}."""
    now = claims_hash((meta.get("study") or {}).get("verdict"))
    measured: dict[str, int] = {}
    for job in jobs:
        key = job.get("claims")
        if isinstance(key, str):
            measured[key] = measured.get(key, 0) + 1
    return {"now": now, "measured": dict(sorted(measured.items())),
            "changed": sum(n for key, n in measured.items() if key != now),
            "unrecorded": sum(not isinstance(j.get("claims"), str) for j in jobs)}


def claims_line(meta: dict, jobs: list[dict]) -> str | None:
    """The page's one line where its claims were edited after (some of) its runs were measured; else None."""
    seen = claims_changed(meta, jobs)
    if not seen["changed"]:
        return None
    before = ", ".join(k for k in seen["measured"] if k != seen["now"])
    return (f"The claims below were edited after the data was measured: {seen['changed']} of {len(jobs)} runs "
            f"were measured under other claims (fingerprint {before}; now {seen['now']}).")
