"""Tensor snapshots: copies of named module outputs, by name pattern and step range, written
to safetensors files with their metadata; off unless asked for, bounded in bytes.

    ModuleCapture       forward hooks on the modules whose names match; keeps copies in memory
    SnapshotRecorder    a capture per engine step in ``steps``, one file per step:
                        snapshot-step000012-rank0.safetensors, metadata (step, rank, request
                        ids, model) in the safetensors header
    load_snapshot(s)    reads them back (the accuracy debugger compares two of them)

A tensor is stored under ``{module}@{call}:{output}``: the module's name, which call in the
step (a layer runs once per forward; a module may run more often), which tensor of its output
(a tuple or list output stores each).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

DEFAULT_MAX_BYTES = 256 << 20


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a module's output: itself, or those of a tuple, list or HF ModelOutput."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):  # transformers' ModelOutput is an ordered dict
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


@dataclass
class ModuleCapture:
    """Copies (float32, CPU) of the outputs of ``model``'s modules whose names match one of
    ``patterns`` (fnmatch, e.g. ``model.layers.*.mlp``), while attached (``with``).

    Stops copying once ``max_bytes`` are held; ``num_dropped`` counts the outputs left out.
    ``active`` gates capture (a recorder turns it off outside its step range).
    """

    model: nn.Module
    patterns: Sequence[str] | Callable[[str], bool]
    max_bytes: int = DEFAULT_MAX_BYTES
    # module -> per call, its output tensors
    outputs: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # modules in order of their first output
    num_bytes: int = 0
    num_dropped: int = 0
    active: bool = True
    _handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")

    def matches(self, name: str) -> bool:
        if callable(self.patterns):
            return self.patterns(name)
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def __enter__(self) -> ModuleCapture:
        for name, module in self.model.named_modules():
            if self.matches(name):
                self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.active:
                return
            tensors = output_tensors(output)
            size = sum(t.numel() * 4 for t in tensors)
            if self.num_bytes + size > self.max_bytes:
                self.num_dropped += 1
                return
            self.num_bytes += size
            # A copy: the model may later write into its own outputs in place (fused adds).
            copies = [t.detach().float().cpu().clone() for t in tensors]
            if name not in self.outputs:
                self.order.append(name)
            self.outputs.setdefault(name, []).append(copies)

        return hook

    def clear(self) -> None:
        self.outputs.clear()
        self.order.clear()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{module}@{call}:{output}`` keys, in capture order."""
        return {
            f"{name}@{call}:{index}": t
            for name in self.order
            for call, ts in enumerate(self.outputs[name])
            for index, t in enumerate(ts)
        }


@dataclass
class Snapshot:
    """One snapshot file's tensors and metadata."""

    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def modules(self) -> list[str]:
        """Module names in capture order."""
        return list(dict.fromkeys(key.rsplit("@", 1)[0] for key in self.tensors))

    def calls(self, module: str) -> list[list[torch.Tensor]]:
        """Per call of ``module``, its output tensors."""
        calls: dict[int, dict[int, torch.Tensor]] = {}
        for key, t in self.tensors.items():
            name, rest = key.rsplit("@", 1)
            if name == module:
                call, index = (int(x) for x in rest.split(":"))
                calls.setdefault(call, {})[index] = t
        return [[c[i] for i in sorted(c)] for _, c in sorted(calls.items())]


def write_snapshot(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]
) -> int:
    """Writes ``{module}@{call}:{output}`` tensors (in capture order) with ``metadata``
    (JSON-encoded values); returns the file's bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {k: json.dumps(v) for k, v in metadata.items()}
    header["order"] = json.dumps(list(dict.fromkeys(k.rsplit("@", 1)[0] for k in tensors)))
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata=header)
    return path.stat().st_size


def load_snapshot(path: str | Path) -> Snapshot:
    """Reads one snapshot file; tensors in the order they were captured."""
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        metadata = {k: json.loads(v) for k, v in header.items()}
        order = metadata.pop("order", [])
        rank = {name: i for i, name in enumerate(order)}

        def sort_key(key: str) -> tuple[int, int, int]:
            name, rest = key.rsplit("@", 1)
            call, index = (int(x) for x in rest.split(":"))
            return rank.get(name, len(rank)), call, index

        tensors = {k: f.get_tensor(k) for k in sorted(f.keys(), key=sort_key)}
    return Snapshot(metadata, tensors)


def load_snapshots(directory: str | Path) -> list[Snapshot]:
    """Every ``snapshot-*.safetensors`` under ``directory``, by step then rank."""
    files = sorted(Path(directory).glob("snapshot-*.safetensors"))
    snapshots = [load_snapshot(f) for f in files]
    return sorted(snapshots, key=lambda s: (s.metadata.get("step", 0), s.metadata.get("rank", 0)))


class SnapshotRecorder:
    """Snapshots of an engine's steps ``first_step``..``last_step`` (counted from 0 when
    attached), one file per step under ``out_dir``, ``max_bytes`` across all files.

    ``attach(engine)`` wraps that engine's ``runner.execute`` so that each step knows its
    request ids; ``detach`` restores it.
    """

    def __init__(
        self,
        out_dir: str | Path,
        patterns: Sequence[str],
        first_step: int = 0,
        last_step: int | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        rank: int = 0,
    ) -> None:
        if not patterns:
            raise ValueError("snapshot patterns must name at least one module pattern")
        if first_step < 0 or (last_step is not None and last_step < first_step):
            raise ValueError(f"snapshot steps [{first_step}, {last_step}] are not a range")
        self.out_dir = Path(out_dir)
        self.patterns = list(patterns)
        self.first_step, self.last_step = first_step, last_step
        self.max_bytes = max_bytes
        self.rank = rank
        self.step = 0
        self.bytes_written = 0
        self.files: list[Path] = []
        self._engine: Any = None
        self._capture: ModuleCapture | None = None

    def in_range(self, step: int) -> bool:
        return step >= self.first_step and (self.last_step is None or step <= self.last_step)

    def attach(self, engine: Any) -> SnapshotRecorder:
        runner = engine.runner
        self._engine = engine
        self._capture = ModuleCapture(runner.model, self.patterns, active=False)
        self._capture.__enter__()
        execute = runner.execute

        def recorded(out: Any) -> Any:
            self._begin()
            try:
                return execute(out)
            finally:
                self._end([seq.req_id for seq in out.seqs], engine.config.model.name)

        runner.execute = recorded
        return self

    def detach(self) -> None:
        if self._engine is not None:
            del self._engine.runner.execute  # the instance attribute; the method shows again
            self._engine = None
        if self._capture is not None:
            self._capture.__exit__()
            self._capture = None

    def _begin(self) -> None:
        assert self._capture is not None
        self._capture.clear()
        self._capture.max_bytes = max(0, self.max_bytes - self.bytes_written)
        self._capture.num_bytes = 0
        self._capture.active = self.in_range(self.step)

    def _end(self, request_ids: Iterable[str], model: str | None) -> None:
        assert self._capture is not None
        capture = self._capture
        if capture.active and capture.outputs:
            path = self.out_dir / f"snapshot-step{self.step:06d}-rank{self.rank}.safetensors"
            metadata = {
                "step": self.step,
                "rank": self.rank,
                "request_ids": list(request_ids),
                "model": model,
                "num_dropped": capture.num_dropped,
            }
            self.bytes_written += write_snapshot(path, capture.tensors(), metadata)
            self.files.append(path)
        capture.active = False
        capture.num_dropped = 0
        self.step += 1
