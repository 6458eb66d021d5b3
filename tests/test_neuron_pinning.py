"""NeuronCore pinning: replicas that ask for ``neuron_cores`` get disjoint cores from Ray, and
the neuron backend turns Ray's assignment into the Neuron runtime's environment."""

from __future__ import annotations

import os

import pytest

from neuron_runtime.backends.neuron import neuron_environment, parse_visible_cores


def test_visible_cores_in_both_spellings():
    assert parse_visible_cores("0-3") == [0, 1, 2, 3]
    assert parse_visible_cores("0,1") == [0, 1]
    assert parse_visible_cores("4-5, 8") == [4, 5, 8]
    for bad in ("a-b", "3-1", "1,1", "-2"):
        with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES"):
            parse_visible_cores(bad)


def test_environment_keeps_what_the_user_set():
    env = neuron_environment(
        {
            "NEURON_RT_VISIBLE_CORES": "2-3",
            "NEURON_CC_FLAGS": "-O2",
            "NEURON_LOGICAL_NC_CONFIG": "2",
        }
    )
    assert env["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert env["NEURON_RT_NUM_CORES"] == "2"
    assert env["NEURON_CC_FLAGS"] == "-O2"
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    assert env["PJRT_DEVICE"] == "NEURON"
    defaults = neuron_environment({})
    assert "NEURON_RT_VISIBLE_CORES" not in defaults
    assert defaults["NEURON_LOGICAL_NC_CONFIG"] == "1"
    assert "--model-type=transformer" in defaults["NEURON_CC_FLAGS"]
    assert defaults["NEURON_COMPILE_CACHE_URL"]


def test_the_neuron_backend_says_what_is_missing():
    from neuron_runtime.backends import get_backend

    with pytest.raises(ValueError, match="torch-neuronx"):
        get_backend("neuron", graph_mode="neuronx")
    with pytest.raises(ValueError, match="runs graph_mode neuronx, lazy, openxla, not 'eager'"):
        get_backend("neuron", graph_mode="eager")


@pytest.mark.ray
def test_two_replicas_get_disjoint_cores(serve_cluster):
    """The shared test cluster declares 4 neuron_cores; two replicas ask for 2 each."""
    from ray import serve

    @serve.deployment(
        num_replicas=2, ray_actor_options={"num_cpus": 0.01, "resources": {"neuron_cores": 2}}
    )
    class CoreProbe:
        def __call__(self) -> dict[str, str]:
            return {"pid": str(os.getpid()), **neuron_environment(os.environ)}

    handle = serve.run(CoreProbe.bind(), name="core-probe", route_prefix="/core-probe")
    try:
        seen: dict[str, dict[str, str]] = {}
        for _ in range(50):
            env = handle.remote().result(timeout_s=30)
            seen[env["pid"]] = env
            if len(seen) == 2:
                break
        assert len(seen) == 2, "requests reached only one replica"
        cores = [set(parse_visible_cores(e["NEURON_RT_VISIBLE_CORES"])) for e in seen.values()]
        assert all(len(c) == 2 for c in cores)
        assert not cores[0] & cores[1]
        assert cores[0] | cores[1] == {0, 1, 2, 3}
        assert all(e["NEURON_RT_NUM_CORES"] == "2" for e in seen.values())
    finally:
        serve.delete("core-probe")
