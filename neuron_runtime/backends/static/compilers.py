"""Graph compilers behind one switch (``graph_mode``), each counting its compiles.

- ``inductor``: ``torch.compile`` with shapes specialized (``dynamic=False``), CPU or CUDA;
  each new input shape is one compile, counted by a backend wrapper around inductor.
- ``openxla``: ``torch.compile`` onto torch-xla's dynamo bridge (XLA device).
- ``lazy``: torch-xla's lazy tensors: the step is traced as it runs and cut at
  ``torch_xla.sync()``; XLA compiles each new graph once (its CompileTime metric counts them).
- ``neuronx``: ``lazy`` on NeuronCores, after torch-neuronx is imported (it registers the
  Neuron PJRT plugin and compiles through neuronx-cc).

Device libraries are imported only here, when a compiler of theirs is created.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

StepFn = Callable[..., Any]


class Compiler(Protocol):
    name: str

    def compile(self, fn: StepFn) -> StepFn:
        """A callable equal to ``fn`` that runs as compiled graphs (one per input shape)."""
        ...

    def compile_module(self, module: torch.nn.Module) -> None:
        """Compiles ``module``'s forward in place; modules of one class share the graphs."""
        ...

    @property
    def num_compiles(self) -> int:
        """Graphs compiled so far by this compiler."""
        ...


class InductorCompiler:
    name = "inductor"

    def __init__(self, num_buckets: int) -> None:
        import torch._dynamo

        # One cache entry per bucket and function; the default limit (8) would silently fall
        # back to eager past it.
        limit = max(64, 2 * num_buckets)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit
        )
        self._count = 0

    def _backend(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self._count += 1
        return compile_fx(gm, inputs)

    def compile(self, fn: StepFn) -> StepFn:
        return torch.compile(fn, backend=self._backend, dynamic=False, fullgraph=True)

    def compile_module(self, module: torch.nn.Module) -> None:
        module.compile(backend=self._backend, dynamic=False, fullgraph=True)

    @property
    def num_compiles(self) -> int:
        return self._count


class OpenXLACompiler(InductorCompiler):
    name = "openxla"

    def _backend(self, gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self._count += 1
        return lookup_backend("openxla")(gm, inputs)


class LazyXLACompiler:
    """Runs ``fn`` on lazy XLA tensors and cuts the graph after each call."""

    name = "lazy"

    def __init__(self, num_buckets: int) -> None:
        import torch_xla  # noqa: F401 (registers the XLA device)
        import torch_xla.debug.metrics as met

        self._metrics = met

    def compile(self, fn: StepFn) -> StepFn:
        import torch_xla

        def run(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            torch_xla.sync()
            return out

        return run

    def compile_module(self, module: torch.nn.Module) -> None:
        raise ValueError(f"graph_mode {self.name!r} traces whole steps (compile_scope: step)")

    @property
    def num_compiles(self) -> int:
        data = self._metrics.metric_data("CompileTime")
        return 0 if data is None else int(data[0])


class NeuronXCompiler(LazyXLACompiler):
    name = "neuronx"

    def __init__(self, num_buckets: int) -> None:
        import torch_neuronx  # noqa: F401 (registers the Neuron PJRT plugin)

        super().__init__(num_buckets)


_COMPILERS: dict[str, type[Any]] = {
    "inductor": InductorCompiler,
    "openxla": OpenXLACompiler,
    "lazy": LazyXLACompiler,
    "neuronx": NeuronXCompiler,
}


def make_compiler(graph_mode: str, num_buckets: int) -> Compiler:
    """The compiler of ``graph_mode``; ValueError when it is not one (``eager`` is not)."""
    try:
        cls = _COMPILERS[graph_mode]
    except KeyError:
        raise ValueError(f"graph_mode {graph_mode!r} has no compiler") from None
    compiler: Compiler = cls(num_buckets)
    return compiler


def set_cache_dir(graph_mode: str, path: str) -> None:
    """Points the compiler's persistent cache at ``path`` (before its first compile)."""
    os.makedirs(path, exist_ok=True)
    if graph_mode == "inductor":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    elif graph_mode == "neuronx":
        os.environ.setdefault("NEURON_COMPILE_CACHE_URL", path)
    else:
        import torch_xla.runtime as xr

        xr.initialize_cache(path, readonly=False)
