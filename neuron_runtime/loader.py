"""Read HF checkpoints: config.json and safetensors weights (single file, sharded, or loose)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors import safe_open

from neuron_runtime.parallel.loading import checkpoint_slicer, finish_loading

PathLike = str | os.PathLike[str]


class WeightLoadable(Protocol):
    """A model that takes its weights as HF-named tensors."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def load_hf_config(path: PathLike) -> dict[str, Any]:
    """Return the parsed ``config.json`` of the HF model folder ``path``."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} is not an HF model folder: config.json is missing")
    return json.loads(config_file.read_text())


def iter_weights(
    path: PathLike,
    keep: Callable[[str], bool] | None = None,
    rank_slice: Callable[[str], tuple[int, int, int] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight in the folder, floating tensors as float32.

    Tensors are read one at a time, so peak memory is one checkpoint tensor beyond the model.
    ``keep`` selects by name: the others are never read (a vision tower skips the LM).
    ``rank_slice`` (tensor parallelism) gives the (dim, start, length) part of a tensor this
    rank holds, or None for all of it: only that part is read from the file; a part of length
    0 (an expert held by another rank) skips the tensor.
    """
    for shard in _safetensors_files(Path(path)):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open objects are not iterable)
                if keep is not None and not keep(name):
                    continue
                part = rank_slice(name) if rank_slice is not None else None
                if part is None:
                    tensor = f.get_tensor(name)
                else:
                    dim, start, length = part
                    if length == 0:
                        continue
                    index = (slice(None),) * dim + (slice(start, start + length),)
                    tensor = f.get_slice(name)[index]
                yield name, tensor.float() if tensor.is_floating_point() else tensor


def load_model(
    model_cls: Callable[[dict[str, Any]], torch.nn.Module],
    hf_config: dict[str, Any],
    path: PathLike,
) -> torch.nn.Module:
    """Build ``model_cls(hf_config)``, load the folder's weights into it, return it in eval mode.

    The model must implement ``load_weights`` (see ``WeightLoadable``).
    """
    model = model_cls(hf_config)
    # nn.Module declares no load_weights; every model class in neuron_runtime.models has one.
    weights = iter_weights(path, rank_slice=checkpoint_slicer(model))
    cast(WeightLoadable, model).load_weights(weights)
    finish_loading(model)
    quant = hf_config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        from neuron_runtime.model_store import gguf_source

        # The CPU kernels pack the quantized blocks of the file the folder was converted from.
        model.gguf_file = gguf_source(path)  # type: ignore[assignment]
    return model.eval()


def copy_weights(
    module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str
) -> None:
    """Copies HF-named tensors into ``module``'s parameters of the same names, checking that
    every name has a place, every shape matches and no parameter is left out."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {what}")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {what} weights: {missing[:5]}")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        # dict.fromkeys keeps the first-seen shard order while removing duplicates.
        return [folder / shard for shard in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder} (other formats are not supported)")
    return files
