"""Accuracy tools: logit validation against transformers, the accuracy debugger, the KV
check, tensor snapshots and the profiler (docs/accuracy.md)."""

from neuron_runtime.accuracy.debugger import Divergence, find_divergence
from neuron_runtime.accuracy.kv_check import KVCheck, check_request_kv, compare_kv
from neuron_runtime.accuracy.metrics import TOLERANCES, Tolerance, compare_logits
from neuron_runtime.accuracy.snapshot import (
    ModuleCapture,
    Snapshot,
    SnapshotRecorder,
    load_snapshot,
    load_snapshots,
)
from neuron_runtime.accuracy.validate import (
    PromptSpec,
    ValidationReport,
    Validator,
    load_prompts,
    validate,
)

__all__ = [
    "TOLERANCES",
    "Divergence",
    "KVCheck",
    "ModuleCapture",
    "PromptSpec",
    "Snapshot",
    "SnapshotRecorder",
    "Tolerance",
    "ValidationReport",
    "Validator",
    "check_request_kv",
    "compare_kv",
    "compare_logits",
    "find_divergence",
    "load_prompts",
    "load_snapshot",
    "load_snapshots",
    "validate",
]
