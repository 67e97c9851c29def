"""Command-line inputs at the edges (issue 53, item 8): a sweep whose override only some swept options have, and
the cases tests/test_bad_input_list.py runs as commands, checked here in-process where that is faster."""
import pytest

from blocklab.errors import ConfigError


def test_a_key_only_some_swept_options_have_is_one_line_and_plus_plus_records_those_jobs_invalid(tmp_path, capsys):
    """Hydra composes every job before the first starts and stops the sweep at one it cannot (mha has no
    attn.gate_rank): refused in one line naming the key, the jobs and ++ as the fix. With ++ every job composes,
    and the mha job is listed invalid (recorded so when its turn comes), as docs/running.md says."""
    from blocklab.train.sweep import check_sweep_jobs

    sweep = tmp_path / "sweep"
    with pytest.raises(ConfigError) as refused:
        check_sweep_jobs(["attn=gla,mha", "attn.gate_rank=8", f"hydra.sweep.dir={sweep}"])
    line = str(refused.value)
    assert len(line.splitlines()) == 1
    assert "attn.gate_rank=8 cannot be set in 1 of 2 jobs (attn=mha)" in line and "++attn.gate_rank=8" in line
    assert check_sweep_jobs(["attn=gla,mha", "++attn.gate_rank=8", f"hydra.sweep.dir={sweep}"]) == 2
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: job attn=mha,++attn.gate_rank=8 is invalid")
    assert not sweep.exists()
