"""The ``gdn`` command line: ``train``, ``generate``, ``eval``, ``mqar``, ``bench``, ``tokenizer``, ``convert``,
``demo``.

Every ``train``/``mqar`` option is also a config-file key (YAML or JSON, ``--config``); flags
override the file and ``--set key=value`` overrides both (``--set model.hidden_size=256``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys



def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("matplotlib", "PIL", "urllib3", "filelock", "httpx", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a language model", description="Train a causal LM. Without --data: "
                       "a byte-level model on this Python's standard library sources.")
    p.add_argument("--config", help="YAML or JSON file of TrainConfig keys")
    p.add_argument("--preset", help="model preset: gdn, gdn-h1, gdn-h2, deltanet-transformer, qwen3next, transformer")
    p.add_argument("--size", help="model size: tiny, 125m, 340m, 1.3b")
    p.add_argument("--data", help="text file/folder, .jsonl, .bin, hf:NAME or hf:PATH (default: stdlib *.py)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--out", help="run folder (config, metrics, checkpoints, loss curve)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="CKPT",
                   help="continue from the newest checkpoint under --out, or from CKPT (a checkpoint or run folder), "
                        "with the settings saved in it; only the options given now change")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any config key (repeatable)")
    p.add_argument("--list-keys", action="store_true",
                   help="list every config key (for --config files and --set) with its type and default, and exit")


def _add_ckpt(p) -> None:
    """The checkpoint argument of generate and eval: ``--ckpt PATH`` or the path alone."""
    p.add_argument("ckpt_path", nargs="?", default=None, metavar="CKPT",
                   help="checkpoint folder or run folder (newest checkpoint); or give it as --ckpt")
    p.add_argument("--ckpt", default=None, help="checkpoint folder or run folder (newest checkpoint)")


def _checkpoint_arg(parser, args) -> None:
    """Set ``args.ckpt`` from the positional path or ``--ckpt`` (a usage error: neither, or two
    different ones)."""
    pos, opt = args.__dict__.pop("ckpt_path", None), args.ckpt
    if pos is not None and opt is not None and pos != opt:
        parser.error(f"two checkpoints given ({pos!r} and --ckpt {opt!r}): give one")
    if pos is None and opt is None:
        parser.error("a checkpoint is required: gdn " + args.command + " RUN_OR_CHECKPOINT (or --ckpt PATH)")
    args.ckpt = opt if opt is not None else pos


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint")
    _add_ckpt(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue (repeatable: several prompts decode as one batch, shared prefixes "
                        "prefilled once)")
    p.add_argument("--prompts-file", default=None,
                   help="a file of prompts, one per line (blank lines skipped), after any --prompt")
    p.add_argument("--max-new-tokens", type=_positive_int, default=200, help="tokens to generate")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="with more prompts than this, decode at most this many at a time, a finished "
                        "sequence's slot taking the next prompt (prefilled packed, no padding)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=_positive_int, default=None, help="sample among the k most likely")
    p.add_argument("--top-p", type=_probability, default=0.95, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--graph", action="store_true",
                   help="decode on a fixed-shape static cache, replayed as CUDA graphs on a GPU; with more "
                        "prompts than --batch-size, newcomers are written into finished rows in place, so one "
                        "graph serves the whole run")


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="perplexity / bits per byte, or lm-eval tasks, of a checkpoint")
    _add_ckpt(p)
    p.add_argument("--data", default=None,
                   help="held-out text (a source as for train; its held-out split; default: the run's data)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="window length (default: the run's)")
    p.add_argument("--batches", type=_positive_int, default=16, help="packed rows to score")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="windows per row (perplexity) / lm-eval batch size")
    p.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks, e.g. lambada_openai,hellaswag")
    p.add_argument("--include-path", default=None, help="folder of extra lm-eval task YAMLs")
    p.add_argument("--limit", type=_positive_int, default=None, help="lm-eval: examples per task")
    p.add_argument("--device", type=_device, default=None, help="cpu or cuda (default: cuda when available)")


def _add_mqar(sub) -> None:
    p = sub.add_parser("mqar", help="multi-query associative recall across mixers, widths and pair counts")
    p.add_argument("--preset", default="cpu-small", help="cpu-small (<= 10 min on 2 CPU cores) or paper (GPU)")
    p.add_argument("--config", help="YAML or JSON file of MQARConfig keys")
    p.add_argument("--out", help="folder for results.json, the table and the plot")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override any MQAR config key (repeatable)")


def _add_bench(sub) -> None:
    what = "every backend of every op on one random input: agreement with the spec and time"
    sub.add_parser("bench", help=what, description=what.capitalize() + ".",
                   epilog="The full benchmarks are the scripts of benchmarks/ in a source checkout "
                          "(python benchmarks/ops_gpu.py --help); their tables are in docs/BENCHMARKS.md.")


def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tok_command", required=True)
    t = tsub.add_parser("train", help="fit a byte-level BPE with `tokenizers` on local text")
    t.add_argument("--data", default=None, help="a source as for train (default: stdlib *.py)")
    t.add_argument("--vocab-size", type=int, default=8192, help="ids including the 256 bytes and <|endoftext|>")
    t.add_argument("--text-field", default="text", help="JSONL / datasets text column")
    t.add_argument("--out", required=True, help="tokenizer.json to write")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help lines end with the option's default when it has one (not None, not a bare flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "%(default)" in text or "(default:" in text or default in (None, False, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return f"{text} (default: {default!r})" if default == "" else f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    """Help with defaults; a usage error is one line on stderr and exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(convert, ok, what: str):
    """An argparse type: ``convert(text)`` when it parses and ``ok`` holds, else the usage error
    "must be WHAT, got 'TEXT'"."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):  # (NaN fails every comparison)
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive int")
_non_negative_float = _number(float, lambda v: v >= 0, "a non-negative number")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; CUDA only where a CUDA device exists."""
    if text != "cpu" and not text.startswith("cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda (cuda:N), got {text!r}")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available here; use --device cpu")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gdn``."""
    parser = _Parser(prog="gdn", description="Gated DeltaNet toolkit")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    _add_train(sub)
    _add_generate(sub)
    _add_eval(sub)
    _add_mqar(sub)
    _add_bench(sub)
    _add_tokenizer(sub)
    from .compat.convert import add_subparser as _add_convert

    _add_convert(sub)
    sub.add_parser("demo", help="train the tiny model on the stdlib for a few minutes, report bits per byte, "
                   "plot the loss and sample")
    parser.commands = sub.choices  # each command's parser, for usage errors found after parsing
    return parser


def cmd_train(args) -> int:
    if args.list_keys:
        from .models import GDNConfig
        from .train.config import describe_keys

        rows = describe_keys()
        width = max(len(r[0]) for r in rows)
        for key, kind, default, note in rows:
            print(f"{key:<{width}}  {kind:<12}  default {default:<16}  {note}")
        print(f"\nmodel.KEY (--set model.KEY=VALUE, or a model: mapping in --config) sets a GDNConfig "
              f"field: {', '.join(GDNConfig.field_names())}")
        return 0
    from .train import build_config, resume_config, train

    flags = dict(preset=args.preset, size=args.size, data=args.data, steps=args.steps, out=args.out)
    # a resumed run keeps its saved settings; only what this command line gives changes
    cfg = resume_config(args.resume, args.config, flags, args.set) if args.resume else \
        build_config(args.config, flags, args.set)
    res = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        trained = f"train loss {res.train_loss:.4f}" if res.trained else "no step trained"
        if res.skipped:
            trained += f" ({res.skipped} of {res.trained} updates skipped: non-finite loss or gradient norm)"
        print(f"step {res.step}: {trained}, val loss {res.val_loss:.4f}, "
              f"val {res.val_bpb:.3f} bits/byte (unigram {res.unigram_bpb:.3f}); run folder {res.out}")
        if res.diverged:
            print(f"gdn train: error: the run diverged: its last {cfg.max_bad_steps} steps had a non-finite loss or "
                  f"gradient norm and were not applied; checkpoint {res.checkpoint} holds the weights from before them: "
                  "resume from it with a lower learning rate (--resume --set lr=...)", file=sys.stderr)
            return 1
    return 0


def cmd_generate(args) -> int:
    import torch

    from .generation import generate_shared, stream, stream_slots
    from .checkpoint import load_model

    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\r\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file}: {e.strerror or e}") from None
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    prompts = prompts or [""]
    model, tok, path = load_model(args.ckpt, args.device)
    device = next(model.parameters()).device
    start = [tok.eos_id if tok.eos_id is not None else ord("\n")]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, eos_token_id=tok.eos_id, generator=gen)
    if len(prompts) == 1:
        print(prompts[0], end="", flush=True)
        ids = tok.encode(prompts[0]) or start
        out = [int(t[0]) for t in stream(model, torch.tensor([ids], device=device), graph=args.graph, **sampling)]
        print(tok.decode(out))
        return 0
    ids = [tok.encode(p) or start for p in prompts]
    if len(prompts) <= args.batch_size:
        outs = generate_shared(model, ids, graph=args.graph, **sampling)
        for i, (p, new) in enumerate(zip(prompts, outs)):
            if i:
                print("---")
            print(p + tok.decode(new), flush=True)
        return 0
    done: dict[int, list[int]] = {}
    shown = 0
    for i, new in stream_slots(model, ids, batch_size=args.batch_size, graph=args.graph, **sampling):
        done[i] = new
        while shown in done:  # in input order, each as soon as those before it are out
            if shown:
                print("---")
            print(prompts[shown] + tok.decode(done.pop(shown)), flush=True)
            shown += 1
    return 0


def cmd_eval(args) -> int:
    from .checkpoint import find_model_dir

    path = find_model_dir(args.ckpt)
    if args.tasks:
        from .evaluation.harness import run_lm_eval

        results = run_lm_eval(path, args.tasks.split(","), batch_size=args.batch_size, limit=args.limit,
                              device=args.device, include_path=args.include_path)
        for task, metrics in results.items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"{task}: {shown}")
        return 0
    from .evaluation.perplexity import evaluate_checkpoint

    res, unigram = evaluate_checkpoint(path, data=args.data, seq_len=args.seq_len, batches=args.batches,
                                       batch_size=args.batch_size, device=args.device)
    print(f"{path}: loss {res.loss:.4f} nats/token, perplexity {res.perplexity:.3f}, {res.bits_per_byte:.4f} bits/byte "
          f"over {res.tokens} tokens ({res.bytes} bytes); unigram baseline {unigram:.4f} bits/byte")
    return 0


def cmd_mqar(args) -> int:
    from .train.mqar import format_table, mqar_config, run_mqar

    cfg = mqar_config(args.preset, args.config, args.set, out=args.out)
    results = run_mqar(cfg)
    print(format_table(results))
    print(f"results, table and plot in {cfg.out}")
    return 0


def cmd_bench(args) -> int:
    from .demo import print_op_table

    print_op_table()
    return 0


def cmd_tokenizer(args) -> int:
    from .data import iter_texts, train_bpe

    tok = train_bpe(iter_texts(args.data, args.text_field), args.vocab_size, args.out)
    print(f"wrote {args.out}: {tok.vocab_size} ids")
    return 0


def main(argv=None) -> int:
    """Entry point of the ``gdn`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("generate", "eval"):
        _checkpoint_arg(parser.commands[args.command], args)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    _setup_logging(args.verbose)
    if args.command == "demo":
        from .demo import main as demo

        return demo()
    handlers = {"train": cmd_train, "generate": cmd_generate, "eval": cmd_eval, "mqar": cmd_mqar,
                "bench": cmd_bench, "tokenizer": cmd_tokenizer, "convert": lambda a: a.func(a)}
    try:
        return handlers[args.command](args)
    except ValueError as e:
        if args.verbose:
            raise
        print(f"gdn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # checkpoint errors and the like: a message, not a traceback
        from .checkpoint import CheckpointError

        if isinstance(e, CheckpointError) and not args.verbose:
            print(f"gdn {args.command}: checkpoint error: {e}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
