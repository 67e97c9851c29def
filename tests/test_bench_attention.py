"""`python -m blocklab.bench attention --quick`: every registered kind and pattern is measured and
written to JSON, slopes are fitted right, decoding state is reported, the report section renders.
No timing assertions: quick figures mean nothing."""
import json

import pytest

from blocklab.bench import suites
from blocklab.bench.__main__ import main
from blocklab.bench.attention import Variant, fit_slope, variants
from blocklab.model.attention import ATTENTION_KINDS
from blocklab.model.patterns import ATTENTION_PATTERNS, Pattern
from blocklab.report import benches, render


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "attention.json"
    assert main(["attention", "--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_quick_bench_measures_every_registered_kind_and_pattern(bench):
    result = bench["benchmarks"]["attention"]
    summary = result["summary"]
    assert {r["kind"] for r in summary} == set(ATTENTION_KINDS) and not result["skipped"]
    honouring = {r["pattern"] for r in summary if ATTENTION_KINDS[r["kind"]].honours_patterns}
    assert honouring == set(ATTENTION_PATTERNS)
    assert sum(r["explicit"] for r in summary) == 1  # the O(n^2) reference
    lengths = result["settings"]["lengths"]
    for row in summary:
        assert len(row["ms"]) == len(row["peak_mb"]) == len(row["saved_mb"]) == len(lengths)
        assert all(v > 0 for v in row["ms"] + row["peak_mb"] + row["saved_mb"])
        assert row["ms_slope"] is not None and row["peak_mb_slope"] is not None
    # a kind the config refuses causal runs non-causal, and a note says so
    for row in summary:
        if not row["causal"]:
            assert any(note.startswith(f"{row['variant']} runs non-causal") for note in result["notes"])
    assert {"sweep", "variant", "length", "pos", "path", "ms", "peak_mb", "saved_mb"} <= set(result["rows"][0])


def test_the_explicit_path_holds_more_than_the_fused_one(bench):
    """Memory is torch's own accounting, so it is exact: materialised weights are (n, n)."""
    by = {r["variant"]: r for r in bench["benchmarks"]["attention"]["summary"]}
    full, explicit = Variant("softmax", "full"), Variant("softmax", "full", explicit=True)
    assert by[explicit.label]["peak_mb"][-1] > by[full.label]["peak_mb"][-1]
    assert by[explicit.label]["saved_mb"][-1] > by[full.label]["saved_mb"][-1]


FIXED_STATE = ("linear", "performer", "gla", "deltanet", "based")  # every registered kind with no bytes per token


def test_decoding_reports_fixed_state_window_cache_and_growing_kv(bench):
    result = bench["benchmarks"]["attention"]
    dec = {r["variant"]: r for r in result["decode"]}
    reach = result["settings"]["reach"]["window"]
    for label in FIXED_STATE:
        assert len(set(dec[label]["state_bytes"])) == 1 and dec[label]["keys_held"][-1] == 0
    assert dec["softmax/window"]["keys_held"][-1] == reach
    full = dec["softmax/full"]
    assert full["keys_held"] == full["lengths"]
    per_token = full["state_bytes"][0] / full["lengths"][0]
    assert full["state_bytes"] == [per_token * n for n in full["lengths"]]  # linear growth
    assert all(r["tokens_per_s"] > 0 for r in result["decode"])


def test_targets_are_the_issues_and_say_pass_or_miss(bench):
    targets = bench["benchmarks"]["attention"]["targets"]
    n = max(bench["benchmarks"]["attention"]["settings"]["lengths"])
    expected = {"explicit_time_slope", "explicit_memory_slope", f"window_speedup_vs_full_at_{n}",
                "window_cache_keys", *(f"{v}_decoding_state_growth" for v in FIXED_STATE),
                *(f"{v}_{m}_slope" for v in ("softmax_window", "softmax_strided", *FIXED_STATE)
                  for m in ("time", "memory"))}
    assert expected <= set(targets)
    for verdict in targets.values():
        assert verdict["met"] == (verdict["off_by"] == 0.0)


class EveryOther(Pattern):
    """A throwaway dense pattern: even distances only."""

    def allows(self, i, j):
        return (i - j) % 2 == 0


def test_a_newly_registered_pattern_shows_up():
    ATTENTION_PATTERNS.register("every_other")(EveryOther)
    try:
        found, _, skipped = variants(32, 128, 8)
        labels = {v.label for v in found}
        assert "softmax/every_other" in labels and not skipped
        assert not any(v.pattern == "every_other" and not ATTENTION_KINDS[v.kind].honours_patterns for v in found)
    finally:
        ATTENTION_PATTERNS.unregister("every_other")


@pytest.mark.parametrize("power", [1.0, 1.5, 2.0])
def test_slope_fit_recovers_a_known_exponent(power):
    lengths = [1024, 2048, 4096, 8192]
    assert fit_slope(lengths, [3e-6 * n ** power for n in lengths]) == pytest.approx(power, abs=1e-3)
    noisy = [3e-6 * n ** power * (1 + 0.02 * (-1) ** i) for i, n in enumerate(lengths)]
    assert fit_slope(lengths, noisy) == pytest.approx(power, abs=0.05)
    assert fit_slope(lengths, [1.0, None, 2.0, 3.0]) is None


def test_report_section_renders_from_the_json(bench, tmp_path, monkeypatch):
    page = render.section(benches.section_data("attention", bench, tmp_path))
    result = bench["benchmarks"]["attention"]
    assert page.startswith("<section id='attention_costs'>") and page.endswith("</section>")
    assert "data:image/png;base64," in page and (tmp_path / "attention_costs.png").stat().st_size > 0
    for row in result["summary"]:
        assert row["variant"] in page
    assert page.count("PASS") + page.count("MISS") == len(result["targets"])
    monkeypatch.chdir(tmp_path)  # no outputs/bench here: only the files given are read
    path, other = tmp_path / "attention.json", tmp_path / "other.json"
    path.write_text(json.dumps(bench))
    other.write_text(json.dumps({"benchmarks": {}}))
    assert "<img" in benches.section("attention", tmp_path, tmp_path, [path])  # a file given with --bench
    assert "python -m blocklab.bench attention" in benches.section("attention", tmp_path, tmp_path, [other])


def test_quick_flag_is_the_tiny_size(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(suites.BENCHMARKS, "attention", lambda size: seen.append(size) or {"rows": [{"x": 1}],
                                                                                             "targets": {}})
    main(["attention", "--quick", "--out", str(tmp_path / "b.json")])
    assert seen == ["tiny"]


def test_a_report_of_a_study_that_weighs_cost_carries_the_cost_section(bench, tmp_path, monkeypatch):
    """`study.bench: attention` (attention_kinds, sparse_patterns) adds the bench's section to the report;
    a study without it does not, and without a bench JSON the section says how to make one."""
    from blocklab.report.build import build_report

    monkeypatch.chdir(tmp_path)

    def page(specs: dict) -> str:
        return build_report(tmp_path / "sweep", [], specs).read_text()

    assert "id='attention_costs'" not in page({"pe_copy": {}})
    assert "python -m blocklab.bench attention" in page({"attention_kinds": {"bench": "attention"}})
    (tmp_path / "outputs" / "bench").mkdir(parents=True)
    (tmp_path / "outputs" / "bench" / "attention.json").write_text(json.dumps(bench))
    with_bench = page({"attention_kinds": {"bench": "attention"}})
    assert "id='attention_costs'" in with_bench and "<img" in with_bench
