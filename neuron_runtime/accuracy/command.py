"""``neuron-serve validate``: the command line of ``validate``."""

from __future__ import annotations

import argparse
import sys

from neuron_runtime.accuracy.metrics import TOLERANCES
from neuron_runtime.accuracy.validate import load_prompts, validate
from neuron_runtime.config import DTYPES as ENGINE_DTYPES


def add_validate_command(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "validate",
        help="compare the model's logits with transformers' on the same weights",
        description="Teacher-forced comparison of the engine's logits with transformers' "
        "on the same weights; prints a table, writes JSON, exits 1 past tolerance.",
    )
    cmd.add_argument("--model", default="smollm2-135m-instruct", help="alias or HF folder")
    cmd.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(TOLERANCES),
        help="dtype of the transformers reference; sets the tolerances",
    )
    cmd.add_argument(
        "--engine-dtype",
        default="float32",
        choices=list(ENGINE_DTYPES),
        help="the engine's dtype (bfloat16: linear layers in bf16 on CPUs with AVX512_BF16, "
        "held to the bfloat16 tolerances)",
    )
    cmd.add_argument(
        "--prompts",
        default=None,
        help='.jsonl of {"prompt": ..., "images": [paths]} or a text file, one prompt a line '
        "(default: built-in prompts, with images for a vision model)",
    )
    cmd.add_argument(
        "--max-new-tokens",
        type=int,
        default=8,
        help="reference greedy tokens after each prompt, scored as decode steps",
    )
    cmd.add_argument("--top-k", type=int, default=5)
    cmd.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="the eager runner's device (static-graph devices run the same model code)",
    )
    cmd.add_argument("--num-threads", type=int, default=None)
    cmd.add_argument("--json", default="validate.json", help="where to write the full report")
    cmd.add_argument(
        "--snapshot-dir",
        default=None,
        help="on failure, write both models' module outputs here (safetensors)",
    )
    cmd.add_argument(
        "--no-debug", action="store_true", help="skip the accuracy debugger on failure"
    )


def run_validate(args: argparse.Namespace) -> int:
    """Runs the command; 0 when every sample passes, 1 past tolerance (ValueError: bad input)."""
    prompts = load_prompts(args.prompts) if args.prompts else None
    report = validate(
        args.model,
        dtype=args.dtype,
        prompts=prompts,
        max_new_tokens=args.max_new_tokens,
        top_k=args.top_k,
        device=args.device,
        num_threads=args.num_threads,
        debug=not args.no_debug,
        snapshot_dir=args.snapshot_dir,
        engine_dtype=args.engine_dtype,
    )
    sys.stdout.write(report.table() + "\n")
    report.write_json(args.json)
    sys.stdout.write(f"report: {args.json}\n")
    return 0 if report.passed else 1
