"""The ``kvshrink`` command: ``generate``, ``compress``, ``ask``, ``methods``, ``demo`` (and ``eval``/``report``
from kvshrink.eval)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _parse_options(items: list[str]) -> dict[str, str]:
    from kvshrink.cache.option_text import merge_options, parse_options

    return merge_options([parse_options(item, " in --option") for item in items or []], " in --option")


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


# ---------------------------------------------------------------------------------- one document, many questions
# The document is the start of one user turn of the chat template and each question ends that turn:
# prefix = template head + document, question = "\n\n" + question + template tail (end of turn, assistant
# header). Prefix and question are tokenized apart, so the cache's tokens are exactly the prefix's.
_QUESTION = "{question}"


def document_prompt(tokenizer, document: str) -> tuple[list[int], str]:
    """Token ids of the document part of the prompt, and the template a question is put in."""
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00KVSHRINK-DOCUMENT\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        head, found, tail = text.partition(marker)
        if found:
            ids = tokenizer(head + document, add_special_tokens=False)["input_ids"]
            return ids, "\n\n" + _QUESTION + tail
    return tokenizer(document)["input_ids"], "\n\nQuestion: " + _QUESTION + "\nAnswer:"


def question_ids(tokenizer, template: str, question: str) -> list[int]:
    return tokenizer(template.replace(_QUESTION, question.strip()), add_special_tokens=False)["input_ids"]


def prefill(model, cache, ids, chunk: int, progress: bool = False) -> None:
    """Run ``ids [1, n]`` into ``cache`` ``chunk`` tokens at a time (a progress bar on stderr if asked)."""
    import torch
    from tqdm.auto import tqdm

    bar = tqdm(total=ids.shape[1], unit="tok", desc="prefill", disable=not progress, file=sys.stderr)
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
            bar.update(min(chunk, ids.shape[1] - start))
    bar.close()


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token arrives."""

    def __init__(self, start: float):
        self.start, self.calls, self.seconds = start, 0, float("nan")

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call hands over the prompt
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def answer_from(model, tokenizer, cache, prefix_ids: list[int], question: list[int], max_new_tokens: int,
                start: float | None = None) -> tuple[str, float]:
    """Greedy answer of ``question`` after ``cache`` (holding ``prefix_ids``): ``(text, seconds to first token)``,
    counted from ``start`` (default now)."""
    import torch

    ids = torch.tensor([prefix_ids + question], device=model.device)
    first = _FirstToken(time.perf_counter() if start is None else start)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=max_new_tokens, do_sample=False, streamer=first,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip(), first.seconds


def _load_cached(path: str, args: argparse.Namespace):
    """``(model, tokenizer, cache, prefix ids, question template, load seconds)`` of a saved document.

    The method's one-time set-up in this process (e.g. Shard's Lloyd-Max levels) is done first and
    reported apart: it is paid once per process whatever the prompt, by a fresh prefill too."""
    from kvshrink import load_model, make_cache
    from kvshrink.cache.persist import load_cache, read_metadata

    meta = read_metadata(path)  # a bad file is refused before the model is loaded
    if "question_template" not in meta["extra"]:
        raise ValueError(f"kvshrink: {path} was not written by `kvshrink compress` (no question template)")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    make_cache(meta["method"], model, **meta["options"])
    print(f"[{meta['method']} set-up, once per process: {time.perf_counter() - start:.2f} s]", file=sys.stderr)
    start = time.perf_counter()
    cache = load_cache(path, model)
    seconds = time.perf_counter() - start
    if cache.token_ids is None:
        raise ValueError(f"kvshrink: {path} does not hold the token ids of its document")
    return model, tokenizer, cache, cache.token_ids[0].tolist(), meta["extra"]["question_template"], seconds


def _document_setup(args: argparse.Namespace, document_path: str):
    """``(options, model, tokenizer, prefix ids, question template)`` for compressing the document at
    ``document_path`` with ``args.method``: the options are checked before the model loads."""
    from kvshrink import load_model
    from kvshrink.cache.registry import get_method, resolve_options

    options = _parse_options(args.option)
    resolve_options(get_method(args.method), options)  # fail before loading the model
    document = Path(document_path).read_text()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    prefix, template = document_prompt(tokenizer, document)
    return options, model, tokenizer, prefix, template


def _cmd_compress(args: argparse.Namespace) -> int:
    import torch

    from kvshrink import make_cache
    from kvshrink.cache.persist import save_cache

    if not args.out and not args.store:
        raise ValueError("kvshrink: give --out FILE, --store URL or both")
    options, model, tokenizer, prefix, template = _document_setup(args, args.prompt_file)
    if args.store:
        cache = _compress_into_store(args, model, prefix, template, options)
    else:
        cache = make_cache(args.method, model, **options)
        start = time.perf_counter()
        prefill(model, cache, torch.tensor([prefix], device=model.device), args.chunk, progress=True)
        print(f"prefill {time.perf_counter() - start:.1f} s")
    if args.out:
        start = time.perf_counter()
        save_cache(cache, args.out, extra={"question_template": template}, entropy=args.entropy)
        save_seconds = time.perf_counter() - start
        size = Path(args.out).stat().st_size
        print(f"{args.out}: {len(prefix)} tokens, {size:,} bytes on disk ({size / 2**20:.2f} MiB), "
              f"fp16 KV {cache.fp16_nbytes():,} bytes, ratio {cache.fp16_nbytes() / size:.2f}x "
              f"(in memory {cache.compression_ratio():.2f}x); saved "
              f"{'entropy coded' if args.entropy else 'as in memory'} in {save_seconds:.1f} s")
    return 0


def _store_prefill(args: argparse.Namespace, progress: bool):
    """The CLI's chunked prefill, for `CacheStore.cache_for`."""
    return lambda model, cache, ids: prefill(model, cache, ids, args.chunk, progress=progress)


def _open_store(args: argparse.Namespace):
    from kvshrink.store import CacheStore

    return CacheStore(args.store, entropy=getattr(args, "entropy", True))


def _compress_into_store(args, model, prefix, template, options):
    store = _open_store(args)
    start = time.perf_counter()
    cache, how = store.cache_for(model, prefix, args.method, prefill=_store_prefill(args, True),
                                 extra={"question_template": template}, **options)
    seconds = time.perf_counter() - start
    stored = store.stats.bytes_written
    line = (f"{store.url}: {len(prefix)} tokens, {how} in {seconds:.1f} s; fp16 KV {cache.fp16_nbytes():,} bytes")
    if stored:
        line += f", {stored:,} bytes stored (chunks + manifest), ratio {cache.fp16_nbytes() / stored:.2f}x"
    print(line)
    return cache


def _from_store(args: argparse.Namespace):
    """``(model, tokenizer, cache, prefix ids, question template, seconds)`` of ``--document`` through
    ``--store``: its stored entry, or a prefill stored for the next worker (once across workers)."""
    if not args.document:
        raise ValueError("kvshrink: --store needs --document FILE (the document the questions are about)")
    if getattr(args, "cache", None):
        raise ValueError("kvshrink: give the cache FILE or --store, not both")
    options, model, tokenizer, prefix, template = _document_setup(args, args.document)
    store = _open_store(args)
    start = time.perf_counter()
    cache, how = store.cache_for(model, prefix, args.method, prefill=_store_prefill(args, False),
                                 extra={"question_template": template}, **options)
    seconds = time.perf_counter() - start
    print(f"{store.url}: {len(prefix)} document tokens, {how} in {seconds:.2f} s ({cache.summary()})",
          file=sys.stderr)
    return model, tokenizer, cache, prefix, template, seconds


def _cmd_ask(args: argparse.Namespace) -> int:
    from kvshrink import make_cache

    questions = [q.strip() for q in Path(args.questions).read_text().splitlines() if q.strip()]
    if not questions:
        raise ValueError(f"kvshrink: no questions in {args.questions} (one per line)")
    if args.store:
        model, tokenizer, cache, prefix, template, load_s = _from_store(args)
    elif args.cache:
        model, tokenizer, cache, prefix, template, load_s = _load_cached(args.cache, args)
        print(f"loaded {args.cache}: {cache.summary()} in {load_s:.2f} s")
    else:
        raise ValueError("kvshrink: give the cache FILE or --store URL with --document")
    ttfts, answers = [], []
    for i, question in enumerate(questions, 1):
        start = time.perf_counter()
        text, ttft = answer_from(model, tokenizer, cache.fork(), prefix, question_ids(tokenizer, template, question),
                                 args.max_new_tokens, start)
        ttfts.append(ttft)
        answers.append(text)
        print(f"Q{i}: {question}\nA{i}: {text}\n    [time to first token {ttft:.2f} s, from a fork of the loaded cache]")
    mean = sum(ttfts) / len(ttfts)
    print(f"time to first token: {mean:.2f} s mean over {len(ttfts)} questions (+ {load_s:.2f} s to load the "
          f"{'entry' if args.store else 'file'} once)")
    if args.baseline:
        import torch

        fresh = make_cache(cache.method, model, **cache.options)
        start = time.perf_counter()
        prefill(model, fresh, torch.tensor([prefix], device=model.device), args.chunk)
        text, ttft = answer_from(model, tokenizer, fresh, prefix, question_ids(tokenizer, template, questions[0]),
                                 args.max_new_tokens, start)
        print(f"fresh prefill of document + Q1: time to first token {ttft:.2f} s; from the {'store' if args.store else 'file'} "
              f"{(load_s + ttfts[0]) / ttft:.1%} of it (load + Q1); same answer: {text == answers[0]}")
    return 0


def _generate_from_cache(args: argparse.Namespace) -> int:
    if args.option or args.method != "full":
        raise ValueError("kvshrink: --cache brings its own method and options; drop --method/--option")
    question = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    model, tokenizer, cache, prefix, template, load_s = _load_cached(args.cache, args)
    start = time.perf_counter()
    text, ttft = answer_from(model, tokenizer, cache, prefix, question_ids(tokenizer, template, question),
                             args.max_new_tokens, start)
    seconds = time.perf_counter() - start
    print(text)
    print(f"[{cache.summary()}, loaded in {load_s:.2f} s, first token after {ttft:.2f} s, {seconds:.1f} s]",
          file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def _generate_from_store(args: argparse.Namespace) -> int:
    """The longest stored prefix of the prompt, then a prefill of the rest. With ``--document``, the
    prompt is a question about it and the document's entry is made (once) if missing."""
    from kvshrink import load_model, make_cache
    from kvshrink.cache.registry import get_method, resolve_options

    question = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    if not question.strip():
        raise ValueError("empty prompt: give a question or text with --prompt or --prompt-file")
    start = None
    if args.document:
        model, tokenizer, cache, prefix, template, _ = _from_store(args)
        rest = question_ids(tokenizer, template, question)
        start = time.perf_counter()
    else:
        options = _parse_options(args.option)
        resolve_options(get_method(args.method), options)
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
        ids = chat_input_ids(tokenizer, question)["input_ids"][0].tolist()
        store = _open_store(args)
        start = time.perf_counter()
        cache = store.get(model, ids, args.method, max_tokens=len(ids) - 1, **options)  # >= 1 token left to run
        if cache is None:
            cache = make_cache(args.method, model, **options)
        held = cache.get_seq_length()
        prefix, rest = ids[:held], ids[held:]
        print(f"{store.url}: {held} of {len(ids)} prompt tokens from the store", file=sys.stderr)
    text, ttft = answer_from(model, tokenizer, cache, prefix, rest, args.max_new_tokens, start)
    print(text)
    print(f"[{cache.summary()}, first token after {ttft:.2f} s]", file=sys.stderr if args.quiet_summary else sys.stdout)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvshrink import load_model
    from kvshrink.cache.registry import get_method, resolve_options

    if args.cache:
        return _generate_from_cache(args)
    if args.store:
        return _generate_from_store(args)
    if args.document:
        raise ValueError("kvshrink: --document goes with --store (or compress it, then --cache FILE)")
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


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from kvshrink import load_model
    from kvshrink.cache.option_text import format_options
    from kvshrink.methods.shard.sensitivity import calibrate_shard, check_calibration

    options = _parse_options(args.option)
    check_calibration(args.kl_budget, options)  # fail before loading the model
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    calibration = calibrate_shard(model, tokenizer, args.kl_budget, **options)
    for rung, kl in calibration.tried:
        verdict = "within" if kl <= args.kl_budget else "beyond"
        print(f"{format_options(rung)}: KL {kl:.5f} nats ({verdict} the budget)", file=sys.stderr)
    print(calibration.spec)
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
    p.add_argument("--cache", default=None, metavar="FILE.kvs",
                   help="answer the prompt as a question about the document compressed in FILE (kvshrink compress)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="a cache store (folder or redis://host:port/db): start from the longest stored prefix of the prompt")
    p.add_argument("--document", default=None, metavar="FILE",
                   help="with --store: the prompt is a question about FILE, whose cache is stored once for every worker")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens (with --store --document)")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("compress", help="prefill a document once and save its compressed cache to a file")
    p.add_argument("--method", default="shard")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="method option (repeatable, or comma separated)")
    p.add_argument("--prompt-file", required=True, help="the document (text)")
    p.add_argument("--out", default=None, help="the cache file to write (e.g. doc.kvs)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="also (or instead) put the cache in a store: a folder or redis://host:port/db")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens (Shard prefills much faster in one call)")
    p.add_argument("--no-entropy", dest="entropy", action="store_false",
                   help="store the tensors as held in memory, not losslessly coded (larger file, faster save and load)")
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2)")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_compress)

    p = sub.add_parser("ask", help="answer questions (one per line) about a document compressed by `compress`")
    p.add_argument("cache", metavar="FILE.kvs", nargs="?", help="a file written by compress (or use --store)")
    p.add_argument("--questions", required=True, help="text file, one question per line")
    p.add_argument("--store", default=None, metavar="URL",
                   help="take the document's cache from a store (folder or redis://host:port/db); made once if missing")
    p.add_argument("--document", default=None, metavar="FILE", help="with --store: the document (text)")
    p.add_argument("--method", default="shard", help="with --store: the method of the stored cache")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="with --store: method option")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model", default=None, help="the model that made the file (default: embedded SmolLM2)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the fresh prefill of document + first question (the time comparison)")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk of the fresh-prefill comparison")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_ask)

    from kvshrink.methods.shard.sensitivity import DEFAULT_KL_BUDGET

    p = sub.add_parser("calibrate", help="print Shard's options for a model: the cheapest ladder setting within a KL "
                                         "budget on a calibration text (a method spec for --method/--methods)")
    p.add_argument("--kl-budget", type=float, default=DEFAULT_KL_BUDGET,
                   help=f"KL(full || shard) in nats per token (default {DEFAULT_KL_BUDGET})")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="another Shard option the ladder's settings add to (repeatable, or comma separated)")
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2)")
    add_device_arguments(p)
    p.set_defaults(func=_cmd_calibrate)

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
