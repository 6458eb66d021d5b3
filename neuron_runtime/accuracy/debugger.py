"""The accuracy debugger: the first module whose output diverges from transformers'.

Both models run the same sequence with forward hooks on their modules (``ModuleCapture``);
each of our modules is paired with transformers' module of the same checkpoint name, and the
pairs are compared in the order our model runs them. The first whose output's relative error
passes ``Tolerance.module_rtol`` is where the divergence starts: a wrong weight shows at the
module that uses it, not at the logits 30 layers later.

How the two sides' names and outputs line up:
- names follow the checkpoint keys on both sides, up to a prefix (``PREFIXES``: LLaVA's
  language model, vision tower and projector sit at other paths in transformers 5);
- our fused projections are the concatenation of transformers' (``FUSED``: q/k/v, gate/up);
- our decoder layers return ``(x, residual)`` for the next layer to add: their output is the
  sum; transformers' layers and attention return a tuple whose first tensor is the output;
- ours runs a sequence in several steps (prefill chunks, decodes): a module's calls are
  concatenated over token rows; transformers' one call has a leading batch row of 1;
- transformers' scaled embeddings (Gemma) fold the scale in, ours applies it after.
Pairs whose shapes still differ (a container whose output means something else) are skipped.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from neuron_runtime.accuracy.metrics import Tolerance, relative_error
from neuron_runtime.accuracy.snapshot import (
    ModuleCapture,
    Snapshot,
    load_snapshot,
    write_snapshot,
)

if TYPE_CHECKING:
    from neuron_runtime.accuracy.teacher import OurEncoder, OurModel, Reference, Sample

# Our name prefix -> transformers' candidates, tried in order (the first that exists wins).
PREFIXES: tuple[tuple[str, str], ...] = (
    ("language_model.model.", "model.language_model."),
    ("language_model.model.", "language_model.model."),
    ("vision_tower.", "model.vision_tower."),
    ("vision_tower.", "model.vision_tower.vision_model."),
    ("vision_tower.", "vision_tower.vision_model."),
    ("multi_modal_projector", "model.multi_modal_projector"),
    ("multi_modal_projector", "multi_modal_projector"),
    ("", ""),
)
# Our fused module -> transformers' modules whose outputs it concatenates (last dim).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LOGITS = "logits"  # the pseudo-module of the final logits, compared last
_LAYER = re.compile(r"^(.*?layers?\.\d+)(\.|$)")


@dataclass(frozen=True)
class ModuleError:
    module: str  # our name
    reference: str  # transformers' name(s), "+"-joined for a fused module
    rel_error: float
    max_abs: float
    shape: tuple[int, ...]


@dataclass
class Divergence:
    """The debugger's finding on one sample: ``first`` is None when no module diverges."""

    sample: str
    tolerance: float
    first: ModuleError | None
    compared: list[ModuleError] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def layer(self) -> str | None:
        """The decoder or encoder layer holding the first divergent module (None: outside)."""
        if self.first is None:
            return None
        match = _LAYER.match(self.first.module)
        return match.group(1) if match else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "module_rtol": self.tolerance,
            "first_divergent_module": None if self.first is None else asdict(self.first),
            "layer": self.layer,
            "compared": [asdict(e) for e in self.compared],
            "skipped": self.skipped,
        }

    def describe(self) -> str:
        if self.first is None:
            return (
                f"debugger ({self.sample}): no module output diverges beyond "
                f"{self.tolerance:g} ({len(self.compared)} compared)"
            )
        f = self.first
        where = f" in {self.layer}" if self.layer else ""
        return (
            f"debugger ({self.sample}): first divergence at {f.module}{where} "
            f"(transformers {f.reference}): relative error {f.rel_error:.2e} > "
            f"{self.tolerance:g}, max abs {f.max_abs:.2e}, output {list(f.shape)}"
        )


def reference_names(ours: nn.Module, ref: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each of our module names -> the transformers module(s) it corresponds to."""
    theirs = dict(ref.named_modules())
    pairs: dict[str, tuple[str, ...]] = {}
    for name, _ in ours.named_modules():
        if not name:
            continue
        head, _, leaf = name.rpartition(".")
        for ours_prefix, ref_prefix in PREFIXES:
            if not name.startswith(ours_prefix):
                continue
            mapped = ref_prefix + name[len(ours_prefix) :]
            if leaf in FUSED:
                base = mapped.rpartition(".")[0]
                parts = tuple(f"{base}.{p}" for p in FUSED[leaf])
                if all(p in theirs for p in parts):
                    pairs[name] = parts
                    break
            elif mapped in theirs:
                pairs[name] = (mapped,)
                break
    return pairs


def _ours_output(module: nn.Module, calls: list[list[torch.Tensor]]) -> torch.Tensor | None:
    rows = []
    for tensors in calls:
        if not tensors:
            return None
        is_layer_pair = (
            hasattr(module, "self_attn")
            and len(tensors) == 2
            and tensors[0].shape == tensors[1].shape
        )
        rows.append(tensors[0] + tensors[1] if is_layer_pair else tensors[0])
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _ref_output(module: nn.Module, calls: list[list[torch.Tensor]]) -> torch.Tensor | None:
    if len(calls) != 1 or not calls[0]:
        return None  # a module transformers runs more than once is not a one-to-one pair
    out = calls[0][0]
    scale = getattr(module, "embed_scale", None)
    if scale is not None:
        out = out / float(scale)
    return out


def _squeeze_batch(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    if ref.dim() == ours.dim() + 1 and ref.shape[0] == 1:
        return ref[0]
    return ref


def _pair_outputs(
    name: str,
    our_modules: dict[str, nn.Module],
    ours: Snapshot,
    ref_modules: dict[str, nn.Module],
    ref: Snapshot,
    pairs: dict[str, tuple[str, ...]],
) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(our output, transformers', transformers' name) of one module; None when unpaired."""
    if name == LOGITS:
        return ours.calls(LOGITS)[0][0], ref.calls(LOGITS)[0][0], LOGITS
    if name not in pairs:
        return None
    got = _ours_output(our_modules[name], ours.calls(name))
    parts = [_ref_output(ref_modules[p], ref.calls(p)) for p in pairs[name]]
    present = [p for p in parts if p is not None]
    if got is None or len(present) != len(parts):
        return None
    expected = present[0] if len(present) == 1 else torch.cat(present, dim=-1)
    return got, _squeeze_batch(got, expected), "+".join(pairs[name])


def compare_captures(
    ours_model: nn.Module,
    ours: Snapshot,
    ref_model: nn.Module,
    ref: Snapshot,
    pairs: dict[str, tuple[str, ...]],
    tol: Tolerance,
    sample: str,
) -> Divergence:
    """Walks our modules in the order they ran; the first beyond ``module_rtol`` diverges."""
    our_modules = dict(ours_model.named_modules())
    ref_modules = dict(ref_model.named_modules())
    result = Divergence(sample, tol.module_rtol, None)
    for name in ours.modules:
        pair = _pair_outputs(name, our_modules, ours, ref_modules, ref, pairs)
        if pair is None:
            if name in pairs:
                result.skipped.append(name)
            continue
        got, expected, ref_name = pair
        if got.shape != expected.shape:
            result.skipped.append(name)
            continue
        err = ModuleError(
            name,
            ref_name,
            relative_error(got, expected),
            float((got.double() - expected.double()).abs().max()),
            tuple(got.shape),
        )
        result.compared.append(err)
        if result.first is None and err.rel_error > tol.module_rtol:
            result.first = err
    return result


def capture_both(
    ours: OurModel | OurEncoder, reference: Reference, sample: Sample
) -> tuple[Snapshot, Snapshot, dict[str, tuple[str, ...]]]:
    """Both models' module outputs on ``sample`` (with the final logits as ``logits``)."""
    from neuron_runtime.accuracy.teacher import OurEncoder

    pairs = reference_names(ours.model, reference.model)
    wanted = {p for parts in pairs.values() for p in parts}
    unbounded = 1 << 62
    with ModuleCapture(ours.model, lambda n: n in pairs, unbounded) as ours_capture:
        if isinstance(ours, OurEncoder):
            our_logits = ours.hidden_states(sample)
        else:
            our_logits = ours.logits(sample)
    with ModuleCapture(reference.model, lambda n: n in wanted, unbounded) as ref_capture:
        ref_logits = reference.logits(sample)
    for capture, logits in ((ours_capture, our_logits), (ref_capture, ref_logits)):
        capture.order.append(LOGITS)
        capture.outputs[LOGITS] = [[logits]]
    meta = {"sample": sample.name, "token_ids": sample.token_ids}
    return (
        Snapshot({**meta, "side": "ours"}, ours_capture.tensors()),
        Snapshot({**meta, "side": "reference"}, ref_capture.tensors()),
        pairs,
    )


def find_divergence(
    ours: OurModel | OurEncoder,
    reference: Reference,
    sample: Sample,
    tol: Tolerance,
    snapshot_dir: str | Path | None = None,
) -> Divergence:
    """Runs both models on ``sample`` with hooks and finds the first divergent module.

    With ``snapshot_dir``, both captures are written there (``ours.safetensors``,
    ``reference.safetensors``) and compared as read back by the snapshot loader.
    """
    ours_snap, ref_snap, pairs = capture_both(ours, reference, sample)
    if snapshot_dir is not None:
        ours_snap = _round_trip(ours_snap, Path(snapshot_dir) / "ours.safetensors")
        ref_snap = _round_trip(ref_snap, Path(snapshot_dir) / "reference.safetensors")
    return compare_captures(
        ours.model, ours_snap, reference.model, ref_snap, pairs, tol, sample.name
    )


def _round_trip(snapshot: Snapshot, path: Path) -> Snapshot:
    write_snapshot(path, snapshot.tensors, snapshot.metadata)
    return load_snapshot(path)
