"""The ``kvshrink`` command: ``generate``, ``methods``, ``demo`` (and ``eval``/``report`` from kvshrink.eval)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _parse_options(items: list[str]) -> dict[str, str]:
    from kvshrink.cache.registry import parse_options

    return {k: v for item in items or [] for k, v in parse_options(item, " in --option").items()}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of the model, shared by generate, demo and eval."""
    parser.add_argument("--device", default=None, help="device of the model, e.g. cuda or cuda:1 (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the model's weights and activations (default float32)")


def _cmd_methods(args: argparse.Namespace) -> int:
    from kvshrink import methods
    from kvshrink.cache.registry import options_markdown

    if args.markdown:
        print(options_markdown(), end="")
        return 0
    for name, info in methods().items():
        print(f"{name:14s} {info.description}")
        for opt, spec in info.options.items():
            print(f"    {opt}={spec.default!r:10}  {spec.help}")
    return 0


def chat_input_ids(tokenizer, prompt: str):
    """Token ids of ``prompt`` as one user turn of the model's chat template (plain text if none)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)
    return tokenizer(prompt, return_tensors="pt")


def generate_text(model, tokenizer, prompt: str, method: str, options: dict, max_new_tokens: int):
    """Greedy answer of ``prompt`` through a ``method`` cache: ``(answer, cache, seconds)``."""
    import torch

    from kvshrink import make_cache

    enc = chat_input_ids(tokenizer, prompt)
    enc = {k: v.to(model.device) for k, v in enc.items()}
    cache = make_cache(method, model, **options)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    total = time.perf_counter() - start
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return answer, cache, total


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvshrink import load_model
    from kvshrink.cache.registry import get_method, resolve_options

    options = _parse_options(args.option)
    resolve_options(get_method(args.method), options)  # fail before loading the model
    if args.prompt_file:
        prompt = Path(args.prompt_file).read_text()
    else:
        prompt = args.prompt
    if not prompt.strip():
        raise ValueError("empty prompt: give a question or text with --prompt or --prompt-file")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    answer, cache, seconds = generate_text(model, tokenizer, prompt, args.method, options, args.max_new_tokens)
    print(answer.strip())
    print(f"[{cache.summary()}, {seconds:.1f} s]", file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvshrink.cache.registry import split_specs
    from kvshrink.demo import run_demo

    # split_specs: "lrqk:top_k=512,slot_dtype=float16" is one spec, not two
    return run_demo(length=args.length, methods=split_specs(args.methods), device=args.device, dtype=args.dtype)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshrink", description="Shrink the KV cache of transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list methods and their options")
    p.add_argument("--markdown", action="store_true", help="as Markdown tables (docs/options.md)")
    p.set_defaults(func=_cmd_methods)

    p = sub.add_parser("generate", help="answer a prompt through a compressed cache")
    p.add_argument("--method", default="full")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option (repeatable, or comma separated)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2)")
    p.add_argument("--quiet-summary", action="store_true", help="print the cache summary on stderr")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("demo", help="needle-in-a-haystack demo on the embedded model")
    p.add_argument("--length", type=int, default=3000, help="prompt length in tokens")
    p.add_argument("--methods", default="full,shard", help="comma separated method specs")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_demo)

    try:
        from kvshrink.eval.cli import register as register_eval
    except ImportError:
        register_eval = None
    if register_eval is not None:
        register_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"kvshrink: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
