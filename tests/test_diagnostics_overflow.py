"""A model whose activations overflow (init_depth's 48 layers, Xavier init, no norm) measures inf at init. Its
diagnostics history must still be written, with null where the number is not finite: JSON has no Infinity, and the
write once raised "Out of range float values are not JSON compliant", failing runs that should have been recorded
as diverged."""
import json
import math
from types import SimpleNamespace

from blocklab.train.diagnostics import Diagnostics


def test_a_history_that_measured_inf_is_written_with_null(tmp_path):
    diag = Diagnostics({}, tmp_path / "diagnostics", 10, 1e-3, "none")
    (tmp_path / "diagnostics").mkdir()
    diag.history = [{"tag": "init", "step": 0, "layers": {"activation_rms": [0.02, math.inf, math.nan]}}]
    diag._save(SimpleNamespace(is_global_zero=True))
    written = json.loads((tmp_path / "diagnostics" / "history.json").read_text())
    assert written == [{"tag": "init", "step": 0, "layers": {"activation_rms": [0.02, None, None]}}]
    assert math.isinf(diag.history[0]["layers"]["activation_rms"][1])  # what the run keeps in memory is unchanged
