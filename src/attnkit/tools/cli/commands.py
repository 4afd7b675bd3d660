"""The commands of ``attnkit`` (see :mod:`attnkit.tools.cli`): each checks what it was given, then does its work."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path

import torch

import attnkit
from attnkit import dispatch
from attnkit.tools.cli.parser import build_parser
from attnkit.tools.console import bench_progress, progress, table
from attnkit.tools.files import (
    UsageError,
    filling,
    input_file,
    load_weights,
    one_line,
    output_file,
    output_folder,
    read_tokens,
    require,
    taken_by_other_than_a_file,
)

__all__ = ["COMMANDS", "main"]

TRACE_ELEMENTS = 2**26  # the largest tensor the trace command builds (256 MiB of float32): shapes show at any size
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


# ---------------------------------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> None:
    rows = [
        ("attnkit", attnkit.__version__),
        ("torch", torch.__version__),
        ("python", platform.python_version()),
        ("threads", str(torch.get_num_threads())),
        ("cuda", str(torch.version.cuda) if torch.cuda.is_available() else "not available"),
    ]
    for name, what in dispatch.describe_backends().items():
        rows.append((f"backend {name}", what))
    rows.append(("ring attention", _ring_transports()))
    table(rows, ("", ""), title=None)


def _ring_transports() -> str:
    """Which torch.distributed transports attnkit.distributed.ring_attention can use here."""
    import torch.distributed as dist

    if not dist.is_available():
        return "no: this torch was built without torch.distributed"
    found = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    return "over " + ", ".join(found) if found else "no: neither gloo nor nccl in this torch"


# --------------------------------------------------------------------------------------------------- trace


def cmd_trace(args: argparse.Namespace) -> None:
    if args.valid_lens and len(args.valid_lens) != args.batch:
        raise UsageError(f"--valid-lens has {len(args.valid_lens)} values but --batch is {args.batch}")
    if args.book and args.causal:
        raise UsageError("--causal is not part of the book's layers; leave out --book")
    lens = torch.tensor(args.valid_lens) if args.valid_lens else None
    q_size = args.query_size or args.num_hiddens
    k_size = args.key_size or q_size
    _check_trace_sizes(args, q_size, k_size)
    extra = {"is_causal": True} if args.causal else {}
    try:  # attnkit's validation of the sizes asked for (heads, valid_lens) is the user's to read, in one line
        generator = torch.Generator().manual_seed(0)
        queries = torch.randn(args.batch, args.queries, q_size, generator=generator)
        keys = torch.randn(args.batch, args.keys, k_size, generator=generator)
        layer = _layer(args, q_size, k_size).eval()
        with torch.no_grad(), attnkit.trace_shapes() as t:
            layer(queries, keys, keys, lens, **extra)
    except (ValueError, TypeError) as e:
        raise UsageError(_first_line(e)) from None
    except (RuntimeError, MemoryError) as e:  # sizes too large for this machine
        raise UsageError(f"cannot build a layer and inputs of these sizes here ({type(e).__name__})") from None
    if args.format == "json":
        print(t.to_json())
    elif args.format == "markdown":
        print(t.to_markdown())
    else:
        header = ("module", "step", "shape in", "shape out", "note")
        table([(r[0], r[1], r[2], "-> " + r[3], r[4]) for r in t.rows()], header, title=None)


def _check_trace_sizes(args: argparse.Namespace, q_size: int, k_size: int) -> None:
    """Refuse sizes whose largest tensor would pass ``TRACE_ELEMENTS``, before building anything: each size
    alone is bounded when parsed, but their product could ask for terabytes."""
    B, Lq, Lk, h = args.batch, args.queries, args.keys, args.num_hiddens
    tensors = {
        "queries": (B, Lq, q_size),
        "keys": (B, Lk, k_size),
        "scores": (B, args.num_heads if args.kind == "multihead" else 1, Lq, Lk),
        "a projection's weight": (h, max(q_size, k_size)),
        "additive features": (B, Lq, Lk, h) if args.kind == "additive" else (1,),
    }
    name, shape = max(tensors.items(), key=lambda item: _numel(item[1]))
    if _numel(shape) > TRACE_ELEMENTS:
        raise UsageError(
            f"these sizes need {name} of shape {shape}, {_numel(shape):,} elements; the trace builds at most "
            f"{TRACE_ELEMENTS:,}, and smaller sizes show the same shapes"
        )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _layer(args: argparse.Namespace, q_size: int, k_size: int) -> torch.nn.Module:
    from attnkit import d2l

    h = args.num_hiddens
    if args.kind == "dot":
        if k_size != q_size:
            raise UsageError(f"dot-product attention needs --key-size equal to the query size ({q_size})")
        return d2l.DotProductAttention(0.0) if args.book else attnkit.DotProductAttention()
    if args.kind == "additive":
        if args.book:
            return d2l.AdditiveAttention(k_size, q_size, h, 0.0)
        return attnkit.AdditiveAttention(h, query_size=q_size, key_size=k_size)
    if args.book:
        return d2l.MultiHeadAttention(k_size, q_size, k_size, h, args.num_heads, 0.0)
    return attnkit.MultiHeadAttention(h, args.num_heads, query_size=q_size, key_size=k_size, value_size=k_size)


# ------------------------------------------------------------------------------------------------- heatmap


def cmd_heatmap(args: argparse.Namespace) -> None:
    require("heatmap", "numpy", "matplotlib")
    from attnkit.tools import plot

    source = input_file(args.weights_file, "WEIGHTS_FILE")
    out = output_file(args.out, "--out", IMAGE_SUFFIXES)
    weights = load_weights(source)
    shape = tuple(weights.shape)
    if weights.dim() not in (2, 3, 4):
        raise UsageError(f"{source}: weights must have 2, 3 or 4 dims, got shape {shape}")
    panels = _numel(shape[:-2])  # rows * cols, or H, or 1
    if panels > plot.MAX_PANELS:
        what = "rows and columns, e.g. w[:8, :8]" if weights.dim() == 4 else "heads, e.g. w[:8]"
        raise UsageError(
            f"{source}: weights of shape {shape} would be {panels} panels, more than the {plot.MAX_PANELS} one "
            f"figure takes: save a selection of {what}"
        )
    try:
        if weights.dim() == 4:
            plot.show_heatmaps(weights, args.xlabel, args.ylabel, path=out, title=args.title)
        else:
            plot.plot_attention(weights, path=out, title=args.title, xlabel=args.xlabel, ylabel=args.ylabel)
    except ValueError as e:  # no finite entry; a title or label that matplotlib cannot typeset, such as $\foo$
        raise UsageError(f"{source}: cannot draw these weights: {one_line(e)}") from None
    except OSError as e:  # the disk filled up, the folder went away: plot.save_figure left nothing behind
        raise UsageError(f"--out {out}: cannot write ({e.strerror or one_line(e)})") from None
    print(out)


# ---------------------------------------------------------------------------------------------------- view


def cmd_view(args: argparse.Namespace) -> None:
    require("view", "numpy")
    from attnkit.tools import viewer

    source = input_file(args.weights_file, "WEIGHTS_FILE")
    out = output_file(args.out, "--out", (".html", ".htm"))
    tokens, query_tokens, key_tokens = (
        None if text is None else read_tokens(text, option)
        for text, option in (
            (args.tokens, "--tokens"),
            (args.query_tokens, "--query-tokens"),
            (args.key_tokens, "--key-tokens"),
        )
    )
    weights = load_weights(source, record=True)
    try:
        viewer.view(
            weights,
            tokens,
            query_tokens,
            key_tokens,
            kv_heads=args.kv_heads,
            example=args.example,
            title=args.title or source.name,
            path=out,
        )
    except (ValueError, TypeError) as e:  # shapes, token counts, kv heads, example: the user's to read, in one line
        raise UsageError(f"{source}: {one_line(e)}") from None
    except OSError as e:  # the disk filled up, the folder went away: nothing was left behind
        raise UsageError(f"--out {out}: cannot write ({e.strerror or one_line(e)})") from None
    print(out)


# ---------------------------------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> None:
    require("demo", "numpy", "matplotlib")  # before training, not when the pictures are drawn
    from attnkit.tools import demo
    from attnkit.tools.demo import smollm2

    if args.smollm2:
        given = [flag for flag, used in (("--seed", args.seed is not None), ("--quick", args.quick)) if used]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise UsageError(f"--smollm2 trains nothing: {' and '.join(given)} {verb} not apply to it")
        from attnkit.integrations.smollm2 import check_installed

        try:
            check_installed()
        except ModuleNotFoundError as e:  # what is missing, and how to install it
            raise UsageError(f"--smollm2: {one_line(e)}") from None
    out_dir = output_folder(args.out, "--out")
    for name in smollm2.PICTURES if args.smollm2 else demo.PICTURES:  # a name taken by a folder would fail at the end
        taken = out_dir / name
        if taken_by_other_than_a_file(taken):
            raise UsageError(f"--out {out_dir}: {str(taken)!r} exists and is not a file; the demo writes {name} there")
    if args.smollm2:
        seen = _read_smollm2()
        _write_pictures(out_dir, lambda staging: smollm2.draw(seen, staging))
        return
    demo.replay_book_examples(print)
    results, seed = {}, 0 if args.seed is None else args.seed
    for kind in demo.KINDS:
        print(f"\nTraining the {kind} encoder-decoder to reverse digit sequences ...")
        with progress(kind) as on_progress:
            results[kind] = demo.train(kind, seed=seed, quick=args.quick, on_progress=on_progress)
        r = results[kind]
        summary = f"{r.accuracy:.1%} exact-sequence accuracy on held-out sequences, {r.steps} steps"
        print(f"{kind}: {summary}, {r.seconds:.1f} s")
    _write_pictures(out_dir, lambda staging: demo.draw(results, staging))
    if smollm2.installed():
        print("\nSmolLM2-135M-Instruct is installed: `attnkit demo --smollm2` draws what a pretrained model attends to")


def _read_smollm2() -> dict:
    """SmolLM2 loaded (converted the first time) and its reading of the demo's text and needle, said as it goes."""
    from attnkit.integrations import smollm2 as model_files
    from attnkit.tools.demo import smollm2

    print("Loading SmolLM2-135M-Instruct (converted once from the installed GGUF file) ...")
    try:
        model, tokenizer = model_files.load()
    except ModuleNotFoundError as e:  # what check_installed() found was removed meanwhile
        raise UsageError(f"--smollm2: {one_line(e)}") from None
    except KeyboardInterrupt:
        raise
    except Exception as e:  # the cache cannot be written, or holds a broken conversion (a truncated file, ...)
        folder = model_files.cache_folder()
        reason = getattr(e, "strerror", None) or one_line(e)
        raise UsageError(
            f"--smollm2: cannot convert or load the model in {folder} ({reason}); remove a broken conversion there"
        ) from None
    print(f"Reading {smollm2.TEXT!r}, then a needle question after {smollm2.NEEDLE_TOKENS} tokens of context ...")
    seen = smollm2.read(model, tokenizer)
    for line in smollm2.describe(seen):
        print(f"  {line}")
    return seen


def _write_pictures(out_dir: Path, draw: Callable[[Path], list[Path]]) -> None:
    """``draw(staging)`` into a staging folder renamed into ``out_dir`` (:func:`filling`), then the pictures listed."""
    try:
        with filling(out_dir) as staging:
            names = [path.name for path in draw(staging)]
    except OSError as e:  # the disk filled up, the folder went away: filling left nothing new behind
        raise UsageError(f"--out {out_dir}: cannot write the pictures ({e.strerror or one_line(e)})") from None
    print("\nPictures:")
    for name in names:
        print(f"  {out_dir / name}")


# --------------------------------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> None:
    from attnkit.tools import bench

    compare = None
    if args.compare is not None:
        saved = input_file(args.compare, "--compare")
        try:
            compare = bench.load_json(str(saved))
        except (OSError, ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep, not the structure
            raise UsageError(
                f"--compare {saved}: not results saved with `attnkit bench --json` ({one_line(e)})"
            ) from None
    json_out = output_file(args.json, "--json", (".json",)) if args.json is not None else None
    plot_out = output_file(args.plot, "--plot", (".png",)) if args.plot is not None else None
    if plot_out is not None:
        require("bench --plot", "numpy", "matplotlib")
    with bench_progress() as on_row:
        report = bench.run(quick=args.quick, memory=not args.no_memory, on_row=on_row)
    header, rows = bench.table(report, compare)
    table(rows, header, title=None)
    print(
        f"float32 matmul {report.matmul_gflops:.0f} GFLOP/s, {report.threads} threads, torch {report.torch_version},"
        f" {report.seconds:.0f} s"
    )
    for out, write in ((json_out, bench.save_json), (plot_out, bench.plot_report)):
        if out is not None:
            try:
                write(report, str(out))  # each writes whole or not at all (a temporary file, renamed into place)
            except OSError as e:
                raise UsageError(f"{out}: cannot write ({e.strerror or one_line(e)})") from None
            print(out)


# ---------------------------------------------------------------------------------------------------- main


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "info": cmd_info,
    "trace": cmd_trace,
    "heatmap": cmd_heatmap,
    "view": cmd_view,
    "demo": cmd_demo,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handlers, not at exit
    except UsageError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`attnkit info | head -1`): not an error of ours, and no traceback.
        _drop_stdout()
        return 141
    except OSError as e:  # what the commands write to has failed (stdout on a full disk): one line, no traceback
        _drop_stdout()
        print(f"attnkit: error: cannot write the output ({e.strerror or one_line(e)})", file=sys.stderr)
        return 1
    return 0


def _drop_stdout() -> None:
    """Python would flush stdout again at exit, and complain: point it at devnull first."""
    with suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
