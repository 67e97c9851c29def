"""A job as the dashboards compare it: what it is (task, choices, swept overrides: the HParams) and what it
measured (results.json's scalars: the metrics), and TensorBoard's HParams records of both: one session per
job, one experiment per sweep (every value each HParam took, as filters, and the metrics as columns)."""
import json
import math
import time
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from blocklab import folder
from blocklab.results import METRICS, RESULTS_FILE, flatten, swept_overrides

RESULTS_PREFIX = "results/"  # TensorBoard tags of results.json's values, apart from the training curves
# Not metrics: the choices are HParams, eval rows are taken per length, diagnostics are their own curves (diag/*).
NOT_METRICS = ("choices", "eval", "diagnostics")
MEASURED = ("completed", "diverged")  # statuses of a job that ran to the end and logged its results


def job_hparams(results: dict, overrides: list[str]) -> dict:
    """Task, choices (results.json) and swept overrides (`task.max_len=5` -> task.max_len: 5; a choice of the
    same name wins: it names the variant the model computes). Values are bool, number or string."""
    hparams = {"task": results.get("task"), **results.get("choices", {})}
    for override in OverridesParser.create().parse_overrides(swept_overrides(overrides)):
        hparams.setdefault(override.key_or_group, override.value())
    return {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in hparams.items()}


def result_metrics(results: dict) -> dict[str, float]:
    """results.json's measurements as named scalars: each evaluated length's metrics first (exact_match@16:
    the dashboard's first columns), then every finite number or flag (groups flattened: decode.tokens_per_s)."""
    rows = results.get("eval", [])
    flat = {f"{metric}@{row['length']}": row.get(metric) for metric in METRICS for row in rows}
    flat.update(flatten({k: v for k, v in results.items() if k not in NOT_METRICS}))
    return {k: float(v) for k, v in flat.items() if isinstance(v, (bool, int, float)) and math.isfinite(v)}


def sweep_results(sweep_dir: Path) -> dict[str, dict]:
    """Each job's results.json under a sweep directory, by job folder name, in folder order."""
    return {path.parent.name: folder.read_json(sweep_dir, path.relative_to(sweep_dir))  # a linked job is refused
            for path in sorted(Path(sweep_dir).glob(f"*/{RESULTS_FILE}"))}


def session_summaries(hparams: dict, status: str) -> list:
    """A job's HParams session: its values at the start, its status at the end (diverged: a failure)."""
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for key, value in hparams.items():
        setattr(start.hparams[key], _value_field(value), value)
    end = plugin_data_pb2.SessionEndInfo(end_time_secs=time.time(), status=api_pb2.STATUS_SUCCESS
                                         if status == "completed" else api_pb2.STATUS_FAILURE)
    return [_summary(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=start)),
            _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))]


def experiment_summary(jobs: dict[str, dict]):
    """The sweep's HParams experiment from its jobs' results: each HParam with every value it took (the
    dashboard's filters), each metric a job measured as a column (tag results/NAME). None: nothing measured."""
    from google.protobuf import struct_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    measured = [results for results in jobs.values() if results.get("status") in MEASURED]
    if not measured:
        return None
    values: dict[str, list] = {}
    for results in measured:
        for key, value in job_hparams(results, results.get("overrides", [])).items():
            values.setdefault(key, []).append(value)
    infos = []
    for name, taken in values.items():
        kinds = {_value_field(v) for v in taken}
        field = kinds.pop() if len(kinds) == 1 else "string_value"
        distinct = sorted(set(taken if field != "string_value" else map(str, taken)))
        infos.append(api_pb2.HParamInfo(
            name=name, type={"bool_value": api_pb2.DATA_TYPE_BOOL, "number_value": api_pb2.DATA_TYPE_FLOAT64,
                             "string_value": api_pb2.DATA_TYPE_STRING}[field],
            domain_discrete=struct_pb2.ListValue(values=[struct_pb2.Value(**{field: v}) for v in distinct]),
            differs=len(distinct) > 1))
    metrics = dict.fromkeys(name for results in measured for name in result_metrics(results))
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=[
        api_pb2.MetricInfo(name=api_pb2.MetricName(tag=RESULTS_PREFIX + name)) for name in metrics])
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment))


def _value_field(value) -> str:
    return "bool_value" if isinstance(value, bool) else \
        "number_value" if isinstance(value, (int, float)) else "string_value"


def _summary(tag: str, data):
    """A Summary holding HParams plugin data under one of the plugin's tags."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data),
                                        tensor=metadata.NULL_TENSOR)])
