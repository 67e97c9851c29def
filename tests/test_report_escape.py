"""The report's trust boundary (issue 44, finding 5): a shared sweep folder is untrusted input, so every string of it
that reaches index.html is written as text. A fabricated folder carries two payloads in every such string (task
and study names, the question, override values, seeds, a fixed hyperparameter, machine labels, a failed run's
error and folder name, a metric name, a plot's `where`, and a benchmark file's command, CPU, variants, targets
and notes); the page must show them as text and run none of them, read by html.parser and in headless Chromium."""
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

from omegaconf import OmegaConf

from conftest import report_page

SCRIPT = "<script>window.__pwned=1</script>"
IMG = '"><img src=x onerror=window.__pwned=1>'
PAYLOADS = (SCRIPT, IMG)


def sources(p: str) -> dict[str, str]:
    """Each string of one study that reaches the page, carrying payload `p`."""
    return {name: f"{name} {p}" for name in ("study", "question", "task", "pos", "seed", "lr", "machine", "error",
                                             "where", "metric")}


def fabricate(root: Path) -> dict[str, dict[str, str]]:
    """Two studies (one per payload) of 2 settings x 2 seeds and a failed run each; the `pos {p}` setting does not
    learn in distribution (exact match 0.5), rope does (0.95). Returns each payload's strings."""
    strings = {}
    for i, p in enumerate(PAYLOADS):
        s = strings[p] = sources(p)
        study = {"name": s["study"], "question": s["question"], "compare": ["pos"],
                 "metrics": ["exact_match_in", "exact_match_out", f"costs.{s['metric']}"], "length_table": True,
                 "bench": ["activations", "positions", "attention"],
                 "plots": [{"kind": "bar", "metric": "exact_match_in", "by": "pos", "where": {"task.name": s["where"]}},
                           {"kind": "length_curve", "metric": "exact_match", "by": "pos"}]}
        for pos, em in ((s["pos"], 0.5), ("rope", 0.95)):
            for j, seed in enumerate((0, s["seed"])):
                _write(root / f"study{i}" / f"{pos[:3]}-{j}", study, s, pos, seed, em, machine=s["machine"] if j else "m1")
        _write(root / f"study{i}" / IMG, study, s, "rope", 7, None, machine="m1")  # its folder name reaches the page
    return strings


def _write(run_dir: Path, study: dict, s: dict, pos: str, seed, em: float | None, machine: str) -> None:
    (run_dir / ".hydra").mkdir(parents=True)
    config = {"study": study, "seed": seed, "pos": pos, "task": {"name": s["task"]},
              "trainer": {"max_steps": 100}, "optim": {"lr": s["lr"]}}
    OmegaConf.save(OmegaConf.create(config), run_dir / ".hydra" / "config.yaml")
    base = {"task": s["task"], "study": study["name"], "choices": {"seed": seed, "pos": pos},
            "overrides": [f"pos={pos}", f"seed={seed}"], "machine": machine}
    if em is None:  # a run that failed: its error and folder name reach the page
        results = {**base, "status": "failed", "error": s["error"]}
    else:
        results = {**base, "status": "completed", "params": 5000, "steps": 100, "tokens_per_s": 1000.0,
                   "final_train_loss": 0.1, "final_val_loss": 1 - em, "train_lengths": [1, 3],
                   "costs": {s["metric"]: 1.0},
                   "eval": [{"length": n, "in_distribution": n <= 3, "exact_match": em if n <= 3 else em / 2,
                             "token_acc": em, "loss": 1 - em, "n": 64} for n in range(1, 7)]}
    (run_dir / "results.json").write_text(json.dumps(results))


def bench(p: str) -> dict:
    """A benchmark file (--bench) whose every string carries `p`."""
    target = {f"target {p}": {"value": 1.0, "target": 2.0, "met": True}}
    attention = {"settings": {"lengths": [64, 128], "d_model": 32, "n_heads": 2, "rounds": 3, "reach": {f"reach {p}": 4},
                              "fit_from": 64, "width_length": 64, "widths": [32], "decode_tokens": 8},
                 "summary": [{"variant": f"variant {p}", "causal": True, "skips_masked_work": False, "explicit": False,
                              "ms": [1.0, 4.0], "ms_slope": 2.0, "peak_mb": [1.0, 4.0], "peak_mb_slope": 2.0,
                              "saved_mb_slope": 2.0, "vs_full": 1.0, "width_ms": [1.0], "width_slope": 1.0}],
                 "targets": target, "notes": [f"note {p}"]}
    return {"machine": {"command": f"command {p}", "cpu": f"cpu {p}", "torch": f"torch {p}", "cpu_threads": 1},
            "benchmarks": {
                "attention": attention,
                "activations": {"rows": [{"act": f"act {p}", "ms": 1.0, "vs_fastest": 1.0}], "wall_s": 1.0,
                                "targets": target},
                "step": {"rows": [{"axis": "pos", "variant": f"scheme {p}", "ms": 1.0, "ms_median": 1.0,
                                   "tokens_per_s": 1, "gflop_per_step": 1.0, "vs_nope": 1.0}],
                         "tokens_per_step": 8, "wall_s": 1.0, "targets": {f"x {p}_vs_nope": target[f"target {p}"]}}}}


BENCH_STRINGS = ("command", "cpu", "torch", "variant", "act", "scheme", "note", "target", "reach")


class Page(HTMLParser):
    """The page as a browser's parser reads it: its elements with their attributes, and its text."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags, self.text = [], []
        self.feed(html)
        self.close()
        self.text = "".join(self.text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag

    def handle_data(self, data):
        self.text += [data]


def report(root: Path, bench_file: Path, cwd: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "blocklab.report", str(root), "--bench", str(bench_file)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "report" / "index.html"


def test_every_string_from_the_folder_reaches_the_page_as_text_and_runs_nothing(tmp_path):
    root = tmp_path / IMG  # the sweep folder's own name reaches the title
    strings = fabricate(root)
    bench_file = tmp_path / "bench.json"
    bench_file.write_text(json.dumps(bench(SCRIPT)))
    index = report(root, bench_file, tmp_path)
    html = index.read_text()

    # (a) As html.parser reads it: no element or attribute came from the data, and every payload is text.
    page = Page(html)
    assert [tag for tag, _ in page.tags if tag == "script"] == []
    assert [(tag, a) for tag, attrs in page.tags for a in attrs if a.lower().startswith("on")] == []
    images = [attrs for tag, attrs in page.tags if tag == "img"]
    assert images and all(attrs["src"].startswith("data:image/png;base64,") for attrs in images)
    assert {tag for tag, _ in page.tags} <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "b",
                                             "ul", "li", "a", "section", "div", "table", "thead", "tbody", "tr", "th",
                                             "td", "figure", "img", "figcaption", "code"}
    for p, s in strings.items():
        for name, text in s.items():
            assert text in page.text, f"{name} does not show as text"
    for name in BENCH_STRINGS:
        assert f"{name} {SCRIPT}" in page.text, f"the benchmark's {name} does not show as text"
    assert f"BlockLab report: {root.name}" in page.text
    # Where the strings sit: the study names are the section titles, the seed list is in the budget, the setting
    # that did not learn is flagged by name.
    assert f"seeds 0, seed {SCRIPT}" in page.text and f"optim.lr=lr {SCRIPT}" in page.text
    assert (f"did not learn in distribution: pos=pos {IMG} (in-distribution exact match 0.500 < 0.900 (0 of 2 seeds "
            "clear it))") in page.text

    # (b) In headless Chromium: nothing ran, and the payloads are visible text.
    with report_page(index) as browser:
        assert browser.evaluate("typeof window.__pwned") == "undefined"
        assert browser.evaluate("document.scripts.length") == 0
        assert browser.evaluate("[...document.querySelectorAll('*')].flatMap(e => [...e.attributes])"
                                ".filter(a => a.name.startsWith('on')).length") == 0
        titles = browser.locator("h2").all_inner_texts()
        assert titles[:2] == sorted(strings[p]["study"] for p in PAYLOADS)
        assert titles[2:] == ["activation speed", "position scheme costs", "attention costs"]
        shown = browser.locator("body").inner_text()
        for p, s in strings.items():
            for name, text in s.items():
                assert text in shown, f"{name} is not visible as text"
        for name in BENCH_STRINGS:
            assert f"{name} {SCRIPT}" in shown
        assert browser.evaluate("typeof window.__pwned") == "undefined"  # after the page settled, images included
