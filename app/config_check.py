"""Checks a Serve config file against the applications it builds, before `serve run` starts.

`serve run CONFIG` hands a config file's applications to the Serve controller, which builds
them in a task of its own: when ``app.builder:build_app`` refuses its args the application is
DEPLOY_FAILED with that message and no replica starts, but `serve run` itself keeps waiting.
``python -m app.config_check CONFIG...`` runs the same checks in the foreground and exits
non-zero with one line, so the Makefile runs it before `serve run`. Checked:

- the file parses as Ray's ``ServeDeploySchema`` (what `serve run` and `serve deploy` read);
- each application built by ``app.builder:build_app``: its args (``BuildArgs``, then
  ``validate_args`` against the models on disk);
- every deployment the file configures is one the application builds;
- accelerators: a replica asks for ``neuron_cores`` exactly when its engine runs on device
  "neuron", and for GPUs exactly when it runs on "cuda".

Whether the cluster has those resources is not checked: that needs a connection, and an
autoscaling cluster starts without the nodes that will hold them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from ray.serve._private.build_app import build_app as build_serve_app
from ray.serve.deployment import Deployment
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

from app.builder import BuildArgs, Role, as_deployment, build_openai_app, validate_args
from deployments.decode import DecodeServer
from deployments.llm_server import LLMServer
from deployments.prefill import PrefillServer

BUILDER = "app.builder:build_app"
# Deployments whose replicas run the engine on engine_args.device; the others run on CPU.
ENGINE_DEPLOYMENTS = frozenset(
    as_deployment(cls).name for cls in (LLMServer, PrefillServer, DecodeServer)
)
# engine deployment -> the role whose engine args it runs (BuildArgs.prefill / .decode)
ENGINE_ROLES: dict[str, Role | None] = {
    as_deployment(PrefillServer).name: "prefill",
    as_deployment(DecodeServer).name: "decode",
    as_deployment(LLMServer).name: None,
}
# device -> the Ray resource that places a replica on it (and pins its cores or GPUs)
DEVICE_RESOURCES = {"neuron": "neuron_cores", "cuda": "GPU"}


def check_config(config: dict[str, Any]) -> ServeDeploySchema:
    """The parsed config; ValueError (pydantic's ValidationError included) on the first fault."""
    schema = ServeDeploySchema.model_validate(config)
    _check_known_keys(schema, config, "")
    for app in schema.applications:
        if app.import_path == BUILDER:
            try:
                check_application(app)
            except ValueError as err:
                raise ValueError(f"application {app.name!r}: {one_line(err)}") from None
    return schema


def check_application(app: ServeApplicationSchema) -> None:
    """One application of ``app.builder:build_app``: args, deployment names, accelerators."""
    try:
        args = BuildArgs(**app.args)
    except ValidationError as err:
        raise ValueError(one_line(err, prefix="args.")) from None
    config = validate_args(args)
    built = {d.name: d for d in build_serve_app(build_openai_app(args), name=app.name).deployments}
    overrides = {d.name: d for d in app.deployments}
    for name in overrides:
        if name not in built:
            raise ValueError(
                f"deployments: {name!r} is not a deployment of this application "
                f"(it has {sorted(built)})"
            )
    for name, deployment in built.items():
        override = overrides.get(name)
        device = config.device if name in ENGINE_DEPLOYMENTS else "cpu"
        if name in ENGINE_DEPLOYMENTS:
            engine_args = args.full_engine_args(ENGINE_ROLES[name])
            device = engine_args.get("device", config.device)
            dp = args.data_parallel_size(ENGINE_ROLES[name])
            _check_parallel(name, dp, engine_args, override)
        requested = _requested_resources(deployment, override)
        for accelerator, resource in DEVICE_RESOURCES.items():
            asked = requested.get(resource, 0) > 0
            if asked and device != accelerator:
                where = "its engine runs on" if name in ENGINE_DEPLOYMENTS else "it runs on"
                source = " (engine_args.device)" if name in ENGINE_DEPLOYMENTS else ""
                raise ValueError(
                    f"deployment {name!r} asks for {resource} but {where} device {device!r}{source}"
                )
            if device == accelerator and not asked:
                raise ValueError(
                    f"engine_args.device {device!r} needs {resource} for deployment {name!r}: "
                    f"set its ray_actor_options ({_OPTION_HINTS[resource]})"
                )


def _check_known_keys(model: BaseModel, raw: dict[str, Any], where: str) -> None:
    """Ray's schemas drop keys they do not know; a misspelt option would pass unnoticed."""
    fields = type(model).model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown key {where}{unknown[0]}")
    for name in model.model_fields_set:
        value, raw_value = getattr(model, name), raw.get(fields[name].alias or name)
        if isinstance(value, BaseModel) and isinstance(raw_value, dict):
            _check_known_keys(value, raw_value, f"{where}{name}.")
        elif isinstance(value, list) and isinstance(raw_value, list):
            for index, (item, raw_item) in enumerate(zip(value, raw_value, strict=False)):
                if isinstance(item, BaseModel) and isinstance(raw_item, dict):
                    _check_known_keys(item, raw_item, f"{where}{name}[{index}].")


_OPTION_HINTS = {"neuron_cores": "resources: {neuron_cores: N}", "GPU": "num_gpus: N"}


def _check_parallel(
    name: str, dp: int, engine_args: dict[str, Any], override: DeploymentSchema | None
) -> None:
    """What the builder derives from the parallel degrees, not undone by the config: DP
    fixes the replica count; a TP engine with rank actors needs one bundle per rank."""
    fields = override.model_fields_set if override is not None else set()
    replicas = override.num_replicas if override is not None else None
    if dp > 1 and ("autoscaling_config" in fields or ("num_replicas" in fields and replicas != dp)):
        raise ValueError(
            f"deployment {name!r}: data_parallel_size {dp} fixes its replicas at {dp}; "
            "set neither num_replicas nor autoscaling_config"
        )
    tp = engine_args.get("tensor_parallel_size", 1)
    if tp == 1 or engine_args.get("distributed_executor_backend") != "ray" or override is None:
        return
    if "placement_group_bundles" in fields:
        bundles = override.placement_group_bundles or []
        if len(bundles) != tp:
            raise ValueError(
                f"deployment {name!r}: tensor_parallel_size {tp} needs {tp} "
                f"placement_group_bundles (one per rank), got {len(bundles)}"
            )
    elif "ray_actor_options" in fields:
        raise ValueError(
            f"deployment {name!r}: with tensor_parallel_size {tp} and its ray_actor_options "
            f"set here, set placement_group_bundles too ({tp} bundles, the first holding "
            "ray_actor_options' resources)"
        )


def _requested_resources(
    deployment: Deployment, override: DeploymentSchema | None
) -> dict[str, float]:
    """What one replica asks Ray for: the config's ray_actor_options replace the code's (as
    Serve applies them), plus placement group bundles."""
    if override is not None and "ray_actor_options" in override.model_fields_set:
        options = dict(override.ray_actor_options or {})
    else:
        options = dict(deployment.ray_actor_options or {})
    requested: dict[str, float] = dict(options.get("resources") or {})
    requested["GPU"] = float(options.get("num_gpus") or 0)
    if override is not None and "placement_group_bundles" in override.model_fields_set:
        bundles = override.placement_group_bundles or []
    else:
        bundles = deployment._replica_config.placement_group_bundles or []
    for bundle in bundles:
        for key, amount in bundle.items():
            requested[key] = requested.get(key, 0) + float(amount)
    return requested


def one_line(err: ValueError, prefix: str = "") -> str:
    """A ValueError as one line; a ValidationError as ``field: message`` per fault."""
    if isinstance(err, ValidationError):
        return "; ".join(
            f"{prefix}{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in err.errors()
        )
    return " ".join(str(err).split())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Check Serve config files against the applications they build."
    )
    parser.add_argument("configs", nargs="+", type=Path, help="Serve config YAML files")
    for path in parser.parse_args(argv).configs:
        try:
            check_config(yaml.safe_load(path.read_text()))
        except (OSError, ValueError, yaml.YAMLError) as err:
            message = one_line(err) if isinstance(err, ValueError) else str(err).splitlines()[0]
            sys.exit(f"error: {path}: {message}")
        print(f"{path}: ok")


if __name__ == "__main__":
    main()
