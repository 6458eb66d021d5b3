"""``neuron-serve generate``, ``chat`` and ``validate``: the engine from a terminal."""

from __future__ import annotations

import argparse
import asyncio
import sys

from neuron_runtime.accuracy.command import add_validate_command, run_validate
from neuron_runtime.async_engine import AsyncEngine
from neuron_runtime.config import DTYPES, GRAPH_MODES
from neuron_runtime.engine_args import EngineArgs
from neuron_runtime.sampling_params import SamplingParams


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="alias, HF folder or .gguf"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV budget (default: max(512 MiB, one max-model-len sequence), bounded by "
        "--kv-cache-memory-fraction of the memory available after the weights)",
    )
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=0.5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xla", "neuron"])
    parser.add_argument(
        "--graph-mode",
        default=None,
        choices=list(GRAPH_MODES),
        help="eager, or graphs compiled per shape bucket (default: the device's own)",
    )
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="what the linear layers compute in (bfloat16: CPUs with AVX512_BF16)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="what the KV cache stores (auto: --dtype's)",
    )
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def _engine(args: argparse.Namespace) -> AsyncEngine:
    return AsyncEngine.from_engine_args(
        EngineArgs(
            model=args.model,
            max_model_len=args.max_model_len,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            device=args.device,
            num_threads=args.num_threads,
            graph_mode=args.graph_mode,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


async def _stream(engine: AsyncEngine, prompt: dict | str, params: SamplingParams) -> str:
    text = []
    async for output in engine.generate(prompt, params):
        delta = output.outputs[0].text
        text.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


async def _generate(args: argparse.Namespace) -> None:
    params = _params(args)
    engine = _engine(args)
    try:
        await _stream(engine, args.prompt, params)
    finally:
        engine.shutdown()


async def _chat(args: argparse.Namespace) -> None:
    params = _params(args)
    engine = _engine(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        while True:
            try:
                user = input("> ")
            except EOFError:
                break
            if user.strip() in {"/exit", "/quit"}:
                break
            messages.append({"role": "user", "content": user})
            ids = engine.tokenizer.encode_chat(messages)
            reply = await _stream(engine, {"prompt_token_ids": ids}, params)
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="neuron-serve")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt, streaming the text")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    _add_engine_args(chat)
    chat.add_argument("--system", default=None, help="optional system message")
    add_validate_command(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "validate":
            parser.exit(run_validate(args))
        asyncio.run(_generate(args) if args.command == "generate" else _chat(args))
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")


if __name__ == "__main__":
    main()
