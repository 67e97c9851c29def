"""blocklab.startup: a run imports its libraries without the cyclic garbage collector, freezes them, and trains
with the collector on. gc's state is process-wide, so each case runs in a fresh interpreter."""
import json
import os
import subprocess
import sys
import textwrap

from conftest import ROOT


def in_fresh_python(script: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_imports_run_without_the_collector_and_later_collections_skip_them():
    seen = in_fresh_python("""
        import gc, json, sys
        from blocklab.startup import uncollected_imports
        assert "fractions" not in sys.modules
        with uncollected_imports("fractions"):
            inside = gc.isenabled()
            import fractions
        tracked = {id(o) for o in gc.get_objects()}  # every generation the collector walks
        print(json.dumps({"inside": inside, "after": gc.isenabled(), "frozen": gc.get_freeze_count(),
                          "class_walked": id(fractions.Fraction) in tracked}))
    """)
    assert seen == {"inside": False, "after": True, "frozen": seen["frozen"], "class_walked": False}
    assert seen["frozen"] > 1000


def test_a_later_job_in_the_same_process_leaves_its_garbage_to_the_collector():
    """Once the modules are imported, nothing is frozen: the last job's cycles stay collectable."""
    seen = in_fresh_python("""
        import gc, json, weakref
        import fractions
        from blocklab.startup import uncollected_imports
        class Node: pass
        last_job = Node(); last_job.me = last_job  # a cycle only the collector frees
        alive = weakref.ref(last_job); del last_job
        before = gc.get_freeze_count()
        with uncollected_imports("fractions"):
            inside = gc.isenabled()
        gc.collect()
        print(json.dumps({"inside": inside, "newly_frozen": gc.get_freeze_count() - before,
                          "cycle_freed": alive() is None}))
    """)
    assert seen == {"inside": True, "newly_frozen": 0, "cycle_freed": True}


def test_an_inner_block_leaves_the_collector_to_the_outer_one():
    seen = in_fresh_python("""
        import gc, json
        from blocklab.startup import uncollected_imports
        with uncollected_imports("fractions"):
            with uncollected_imports("decimal"):
                import decimal
            between = gc.isenabled()
            import fractions
        print(json.dumps({"between": between, "after": gc.isenabled()}))
    """)
    assert seen == {"between": False, "after": True}


def test_a_run_trains_with_the_collector_on_and_lightning_frozen(tmp_path):
    """The whole command line (cli.run_and_exit): at the first optimizer step the collector is on (cycles made in
    training are freed) and Lightning's classes, imported by the run, are out of its walks."""
    seen = in_fresh_python(f"""
        import gc, json, sys
        from torch.optim.optimizer import register_optimizer_step_post_hook
        seen = {{}}
        def first_step(optimizer, args, kwargs):
            if not seen:
                import lightning
                seen.update(enabled=gc.isenabled(), trainer_walked=any(o is lightning.Trainer for o in gc.get_objects()))
        register_optimizer_step_post_hook(first_step)
        sys.argv = ["train.py", "trainer=debug", "trainer.max_steps=2", "logger=none", "diagnostics=none",
                    "task.eval_examples=4", "hydra.run.dir={tmp_path / 'run'}"]
        from blocklab.cli import main
        assert "lightning" not in sys.modules
        main()
        print(json.dumps(seen))
    """)
    assert seen == {"enabled": True, "trainer_walked": False}
