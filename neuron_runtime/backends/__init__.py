from neuron_runtime.backends.base import Backend, get_backend

__all__ = ["Backend", "get_backend"]
