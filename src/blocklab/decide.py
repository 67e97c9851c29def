"""`python -m blocklab.decide sweep=NAME [overrides]`: seeds added to a sweep until its registered claims are decided.

The sweep file declares `study.seeds: {min: 3, max: 10}` (or the command adds `+study.seeds={min:3,max:10}`). decide
trains the sweep's missing seeds up to min (every setting), then, one round at a time, one more seed for the settings
the still-open claims compare, and nothing else. After each round it looks at every claim with the group-sequential
design of report/sequential.py (O'Brien-Fleming-type alpha spending over the information fraction n / max, Holm over
the claims), so looking again does not inflate false positives. A claim stops when decided, when its repeated
interval lies inside ±min_effect (no difference that matters), or at max seeds. The jobs run through the sweep's
own launch (`python -m blocklab.train -m sweep=NAME ...`), which skips finished jobs: nothing is trained twice, and a
second decide replays the same looks over the same seeds before going on. What it decided and why is printed and
written to the sweep folder's decide.json (through blocklab.folder)."""
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

import blocklab.modifications  # noqa: F401 - the `modification` group a sweep such as muon_lr picks
from blocklab import folder
from blocklab.errors import ConfigError, exit_on
from blocklab.naming import override_key
from blocklab.paths import CONF_DIR
from blocklab.report import sequential, targets
from blocklab.report.claims import claims_hash

DECIDE_FILE = "decide.json"
DECIDES = ("study.seeds", "study.verdict")  # the keys decide reads and no job is given
SEEDS_FIX = "declare study.seeds: {min: 3, max: 10} in the sweep file (or add +study.seeds={min:3,max:10})"
OUTCOME = {"rejected": None, "trivial": "no difference that matters", "max": "not distinguishable",
           "untestable": "not testable"}


def seeds_error(seeds) -> str | None:
    """One line where study.seeds is not {min: M, max: N} with 2 <= M <= N."""
    if seeds is None:
        return f"the sweep declares no study.seeds, so decide does not know how many seeds it may add; {SEEDS_FIX}"
    ok = (isinstance(seeds, dict) and set(seeds) == {"min", "max"}
          and all(isinstance(seeds[k], int) and not isinstance(seeds[k], bool) for k in ("min", "max"))
          and 2 <= seeds["min"] <= seeds["max"])
    return None if ok else (f"study.seeds={seeds!r} must be {{min: M, max: N}} with 2 <= M <= N (whole numbers of "
                            f"seeds; 2 pairs are the fewest a paired t-test can use); {SEEDS_FIX}")


def min_effect(claim: dict) -> float | None:
    value = claim.get("min_effect") if isinstance(claim, dict) else None
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return float(value) if number else None


def outcome(claim: dict, state: sequential.Claim) -> str:
    """The claim's outcome, in the page's words."""
    if state.state != "rejected":
        return OUTCOME.get(state.state, state.state)
    low, high = state.interval
    if state.min_effect is not None and -state.min_effect <= low and high <= state.min_effect:
        return OUTCOME["trivial"]  # decided, but by less than matters (as the page's fixed-sample rule says it)
    from blocklab.report.judge import higher_is_better

    return "yes" if (state.paired.mean > 0) == higher_is_better(claim.get("metric", "")) else "no"


def decide(claims: list[dict], n_min: int, n_max: int, run: Callable[[list[int] | None, list[int]], None],
           observe: Callable[[int], list], alpha: float = sequential.ALPHA) -> dict:
    """The loop. `run(claims, seeds)`: train those seeds for the settings the numbered claims compare (None: every
    setting of the sweep). `observe(limit)`: for each claim, its per-seed differences over the seeds below limit,
    or why it cannot be tested. Returns the record decide.json keeps."""
    states = [sequential.Claim(min_effect=min_effect(c)) for c in claims]
    rounds = [{"seeds": list(range(n_min)), "claims": "all"}]
    run(None, list(range(n_min)))
    seeds = n_min
    while True:
        sequential.look(states, observe(seeds), n_min, n_max, alpha, last=seeds >= n_max)
        still = [i for i, s in enumerate(states) if s.state == "open"]
        if not still:
            break
        run(still, [seeds])
        rounds.append({"seeds": [seeds], "claims": [i + 1 for i in still]})
        seeds += 1
    return {"design": sequential.DESIGN, "alpha": alpha, "seeds": {"min": n_min, "max": n_max}, "seeds_run": seeds,
            "rounds": rounds, "claims": [_claim_record(i, c, s) for i, (c, s) in enumerate(zip(claims, states), 1)]}


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def _claim_record(number: int, claim: dict, state: sequential.Claim) -> dict:
    p = state.paired
    interval = [_finite(x) for x in state.interval] if state.interval and p else None
    return {"number": number, "claim": claim.get("claim"), "metric": claim.get("metric"),
            "better": claim.get("better"), "than": claim.get("than"), "where": claim.get("where"),
            "min_effect": state.min_effect, "outcome": outcome(claim, state), "state": state.state, "why": state.why,
            "pairs": p.n if p else None, "mean": p.mean if p else None, "sd": p.sd if p else None,
            "p": p.p if p else None, "interval": interval if interval and None not in interval else None,
            "nominal_level": state.nominal, "holm_level": state.level, "spending_level": state.spending,
            "boundary_z": _finite(state.bound),
            "looks": list(state.history)}


# ---------------------------------------------------------------- a real sweep
class Sweep:
    """A sweep file's folder, its jobs launched through `python -m blocklab.train -m` and read back through the
    report's collect (each run's results.json and saved config, through blocklab.folder)."""

    def __init__(self, overrides: list[str]):
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        self.overrides = overrides
        # The claims and the seeds are decide's inputs, not the jobs': passed on, they would name every job's folder
        self.passed = [o for o in overrides if not override_key(o).startswith(DECIDES)]
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)  # a swept setting (k=1,4) names no study
        single = [o for o, p in zip(overrides, parsed) if not p.is_sweep_override()]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
            config = compose("config", [*single, "run_dir=unused"], return_hydra_config=True)
        study = config.get("study")
        if not study or not study.get("name"):
            raise ConfigError("decide needs a sweep file's study (sweep=NAME): python -m blocklab.decide sweep=NAME")
        self.study = OmegaConf.to_container(study, resolve=True)
        self.name = self.study["name"]
        self.dir = Path(config.hydra.sweep.dir)
        from blocklab.report.judge import claims

        self.claims = claims({"study": self.study})
        if not self.claims:
            raise ConfigError(f"sweep {self.name} registers no claim (study.verdict), so there is nothing to decide")
        if error := seeds_error(self.study.get("seeds")):
            raise ConfigError(error)

    def launch(self, settings: list[str], seeds: list[int]) -> None:
        keys = {override_key(o) for o in settings}
        command = [sys.executable, "-m", "blocklab.train", "-m",
                   *(o for o in self.passed if override_key(o) not in keys), *settings,
                   f"seed={','.join(map(str, seeds))}"]
        print("decide:", " ".join(command[2:]), flush=True)
        done = subprocess.run(command)
        if done.returncode:
            raise SystemExit(done.returncode)

    def jobs(self, limit: int | None = None) -> list[dict]:
        from blocklab.report.collect import RUNNING, collect
        from blocklab.report.findings_data import records

        if not self.dir.is_dir():
            return []
        members = [r for r in collect(self.dir) if r.get("study") == self.name and r.get("status") != RUNNING
                   and (limit is None or (isinstance(r.get("seed"), int) and r["seed"] < limit))]
        metrics = sorted({c["metric"] for c in self.claims if isinstance(c, dict) and isinstance(c.get("metric"), str)})
        jobs = records(self.study, members, metrics)
        targets.apply({"study": self.study}, jobs)  # steps_to_target, read off the curves as the page reads it
        return jobs

    def run(self, numbers: list[int] | None, seeds: list[int]) -> None:
        if numbers is None:
            self.launch([], seeds)
            return
        from blocklab.report.judge import sides

        meta, jobs = {"study": self.study}, self.jobs()
        settings = set()
        for i in numbers:
            for _, runs in sides(meta, jobs, self.claims[i]):
                settings |= {tuple(sorted(o for o in j.get("overrides") or [] if override_key(o) != "seed"))
                             for j in runs}
        for launch in launches(settings):
            self.launch(launch, seeds)

    def observe(self, limit: int) -> list:
        from blocklab.report.judge import differences

        meta, jobs = {"study": self.study}, self.jobs(limit)
        return [differences(meta, jobs, c) for c in self.claims]


def launches(settings: set[tuple[str, ...]]) -> list[list[str]]:
    """The settings (each its job's overrides but the seed) as few sweep launches as give exactly them: settings
    setting the same keys whose values form a full grid are one launch (`k=1,4`), so its jobs run side by side;
    any other setting, or a value Hydra's sweep syntax would read otherwise, is a launch of its own."""
    by_keys: dict[tuple, list[tuple[str, ...]]] = {}
    for setting in sorted(settings):
        by_keys.setdefault(tuple(o.partition("=")[0] for o in setting), []).append(setting)
    out = []
    for keys, group in by_keys.items():
        values = [sorted({s[i].partition("=")[2] for s in group}) for i in range(len(keys))]
        plain = all(v and not set(v) & set(",[](){}'\"\\ ") for column in values for v in column)
        if plain and len(keys) == len(set(keys)) and math.prod(map(len, values)) == len(group):
            out.append([f"{k}={','.join(v)}" for k, v in zip(keys, values)])
        else:
            out += [list(s) for s in group]
    return out


def table(record: dict) -> str:
    """The printed table: one line per claim."""
    head = f"{'#':>2}  {'outcome':<26} {'pairs':>5}  {'A - B [repeated interval]':<34} {'p':>8} {'level':>8}  claim"
    lines = [head, "-" * len(head)]
    for c in record["claims"]:
        words = c["outcome"] + (f" at {c['pairs']} seeds" if c["state"] == "max" else "")
        interval = (f"{c['mean']:+.4g} [{c['interval'][0]:.4g}, {c['interval'][1]:.4g}]"
                    if c["interval"] else "–")
        p = f"{c['p']:.3g}" if c["p"] is not None else "–"
        level = f"{c['nominal_level']:.3g}" if c["nominal_level"] is not None else "–"
        lines.append(f"{c['number']:>2}  {words:<26} {c['pairs'] or '–':>5}  {interval:<34} {p:>8} {level:>8}  "
                     f"{c['claim']}")
        lines.append(f"{'':>4}why: {c['why']}")
    lines.append(f"design: {record['design']}; alpha {record['alpha']:g}; seeds {record['seeds']['min']}-"
                 f"{record['seeds']['max']}, {record['seeds_run']} run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--help"], ["-h"]):
        print(__doc__)
        return
    if not argv or any(a.startswith("-") for a in argv):
        exit_on("usage: python -m blocklab.decide sweep=NAME [overrides]: Hydra overrides only, as the sweep's own "
                "launch takes them (no -m)")
    try:
        sweep = Sweep(argv)
    except ConfigError as err:
        exit_on(str(err))
    except Exception as err:  # Hydra's own composition errors: a misspelled sweep or key
        exit_on(f"{' '.join(argv)}: {' '.join(str(err).split())[:300]}")
    seeds = sweep.study["seeds"]
    record = decide(sweep.claims, seeds["min"], seeds["max"], sweep.run, sweep.observe)
    record["command"] = "python -m blocklab.decide " + " ".join(argv)
    record["sweep"] = sweep.name
    record["claims_hash"] = claims_hash(sweep.study.get("verdict"))  # the page applies it to these claims only
    folder.write_json(sweep.dir, DECIDE_FILE, record)
    print(table(record))
    print(f"written: {sweep.dir / DECIDE_FILE}")


if __name__ == "__main__":
    main()
