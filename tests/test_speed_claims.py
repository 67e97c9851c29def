"""A claim on a speed is judged only where its runs were timed alone: a run that trained while other jobs of its
sweep shared the cores (`beside_other_jobs`, recorded in results.json and kept on the findings line) measured its
neighbour as well (attention_cost's MHA seeds once read 654, 196 and 196 ms a step). Such a claim is not testable,
and the page says why; the same runs timed alone are judged as any claim is."""
from blocklab.report import findings
from blocklab.report.judge import AGREES, OUTCOMES

CLAIM = {"claim": "window is faster than full", "metric": "ms_per_step", "better": {"attn": "local"},
         "than": {"attn": "mha"}, "cost_only": True}
MS = {"local": [10.0, 11.0, 10.5], "mha": [20.0, 22.0, 21.0]}


def _jobs(beside: bool) -> list[dict]:
    return [{"job": f"{k}-{s}", "setting": {"attn": k}, "seed": s, "choices": {}, "status": "completed",
             "metrics": {"ms_per_step": x}, "eval": [], "beside_other_jobs": beside}
            for k, xs in MS.items() for s, x in enumerate(xs)]


def _meta() -> dict:
    return {"study": {"compare": ["attn"], "metrics": ["ms_per_step"], "verdict": CLAIM}}


def test_a_speed_timed_beside_other_jobs_cannot_carry_a_verdict():
    outcome, sentence = findings.judge(_meta(), _jobs(beside=True))
    assert OUTCOMES[outcome] == AGREES[outcome] == "not testable"
    assert sentence.startswith("Not testable: ms_per_step is a speed, and 6 of the 6 compared runs were timed while "
                               "other jobs of the sweep ran beside them")


def test_the_same_speeds_timed_alone_are_judged():
    """local - mha per seed: -10, -11, -10.5, mean -10.5 with sd 0.5: decided the claimed way."""
    outcome, sentence = findings.judge(_meta(), _jobs(beside=False))
    assert outcome == "yes", sentence
