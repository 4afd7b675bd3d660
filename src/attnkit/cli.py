"""The ``attnkit`` command (also ``python -m attnkit``).

    attnkit info                                  versions, threads, which backends run here (and why not)
    attnkit trace {dot,additive,multihead} [...]  the shape trace of a freshly built layer
    attnkit heatmap WEIGHTS_FILE --out FILE        draw weights saved with torch.save or numpy.save
    attnkit demo [--out DIR] [--seed N] [--quick]  the book's examples, then train two models and draw them
    attnkit bench [--quick] [--json F] [--compare F] [--plot F]   attnkit against torch and the book

A user mistake prints one line, ``attnkit: error: ...``, and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import attnkit
from attnkit import dispatch


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


LARGEST = 100_000  # sizes the trace command builds tensors of; more is a typo, not a question about shapes


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if not 1 <= value <= LARGEST:
        raise argparse.ArgumentTypeError(f"expected a whole number from 1 to {LARGEST}, got {value}")
    return value


def _lengths(text: str) -> list[int]:
    if not text.strip():
        return []
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, like 3,2; got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnkit", description="Attention mechanisms done right.")
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    commands.add_parser("info", help="versions, threads, and which backends run here")

    t = commands.add_parser("trace", help="the shape trace of a freshly built attention layer")
    t.add_argument("kind", choices=["dot", "additive", "multihead"])
    t.add_argument("--batch", type=_positive, default=2)
    t.add_argument("--queries", type=_positive, default=4, help="number of queries, Lq")
    t.add_argument("--keys", type=_positive, default=6, help="number of keys, Lk")
    t.add_argument("--num-hiddens", type=_positive, default=100)
    t.add_argument("--num-heads", type=_positive, default=5)
    t.add_argument("--query-size", type=_positive, default=None, help="query features (default: num-hiddens)")
    t.add_argument("--key-size", type=_positive, default=None, help="key/value features (default: query size)")
    t.add_argument("--valid-lens", type=_lengths, default=[3, 2], help="one per example, like 3,2 ('' for none)")
    t.add_argument("--causal", action="store_true", help="add a causal mask")
    t.add_argument("--book", action="store_true", help="trace the attnkit.d2l class (the book's view)")
    t.add_argument("--format", choices=["text", "markdown", "json"], default="text")

    h = commands.add_parser("heatmap", help="draw attention weights saved with torch.save or numpy.save")
    h.add_argument("weights_file", metavar="WEIGHTS_FILE")
    h.add_argument("--out", required=True, help="image file; the type follows the extension (png, svg, pdf)")
    h.add_argument("--xlabel", default="keys")
    h.add_argument("--ylabel", default="queries")
    h.add_argument("--title", default=None)

    d = commands.add_parser("demo", help="the book's examples, then train two models and draw what they learned")
    d.add_argument("--out", default="attnkit-demo", help="folder for the pictures (default: ./attnkit-demo)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quick", action="store_true", help="a smaller version, for tests")
    b = commands.add_parser("bench", help="attnkit against torch.nn.MultiheadAttention and the book, one table")
    b.add_argument("--quick", action="store_true", help="a reduced grid (under a minute)")
    b.add_argument("--json", metavar="FILE", help="save the results")
    b.add_argument("--compare", metavar="FILE", help="show the change against results saved with --json")
    b.add_argument("--plot", metavar="FILE", help="a PNG of time and memory against L")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    return parser


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
    _table(rows, ("", ""), title=None)


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
        _table([(r[0], r[1], r[2], "-> " + r[3], r[4]) for r in t.rows()], header, title=None)


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
    from attnkit import plot

    weights = _load_weights(Path(args.weights_file))
    out = _writable_file(Path(args.out))
    if weights.dim() == 4:
        plot.show_heatmaps(weights, args.xlabel, args.ylabel, path=out)
    elif weights.dim() in (2, 3):
        plot.plot_attention(weights, path=out, title=args.title, xlabel=args.xlabel, ylabel=args.ylabel)
    else:
        raise UsageError(f"{args.weights_file}: weights must have 2, 3 or 4 dims, got shape {tuple(weights.shape)}")
    print(out)


def _load_weights(path: Path) -> torch.Tensor:
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        if path.suffix == ".npy":
            import numpy as np

            data: Any = torch.from_numpy(np.load(path, allow_pickle=False))
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any reader failure is the file's fault here, said in one line
        raise UsageError(
            f"{path}: cannot read weights: not a tensor saved with torch.save or an array saved with numpy.save"
            f" ({type(e).__name__})"
        ) from None
    if not isinstance(data, torch.Tensor):
        raise UsageError(f"{path}: expected one tensor or array of weights, got a {type(data).__name__}")
    if not (data.is_floating_point() or data.dtype in (torch.int32, torch.int64)):
        raise UsageError(f"{path}: weights must be real numbers, got dtype {data.dtype}")
    if data.numel() == 0:
        raise UsageError(f"{path}: the weights are empty, shape {tuple(data.shape)}")
    return data.float()


def _writable_file(path: Path) -> Path:
    _writable_parent(path)
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{path}: folder {str(path.parent)!r} cannot be written")
    if path.suffix.lower() not in (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp"):
        raise UsageError(f"{path}: the extension must name an image type, such as .png, .svg or .pdf")
    return path


# ---------------------------------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> None:
    from attnkit import demo

    out_dir = _writable_dir(Path(args.out))
    demo.replay_book_examples(print)
    results = {}
    for kind in demo.KINDS:
        print(f"\nTraining the {kind} encoder-decoder to reverse digit sequences ...")
        with _progress(kind) as on_progress:
            results[kind] = demo.train(kind, seed=args.seed, quick=args.quick, on_progress=on_progress)
        r = results[kind]
        summary = f"{r.accuracy:.1%} exact-sequence accuracy on held-out sequences, {r.steps} steps"
        print(f"{kind}: {summary}, {r.seconds:.1f} s")
    print("\nPictures:")
    for path in demo.draw(results, out_dir):
        print(f"  {path}")


def _writable_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"{path}: cannot write to this folder ({e.strerror or e})") from None
    return path


@contextmanager
def _progress(label: str) -> Iterator[Callable[[dict], None]]:
    """A progress bar with loss, held-out accuracy and time left (rich), or plain lines without rich."""
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:

        def plain(p: dict) -> None:
            acc = "-" if p["accuracy"] is None else f"{p['accuracy']:.1%}"
            print(f"  step {p['step']}/{p['total']}  loss {p['loss']:.3f}  accuracy {acc}", flush=True)

        yield plain
        return
    columns = (
        TextColumn(f"  {label:<9}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps  loss {task.fields[loss]}  accuracy {task.fields[acc]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(label, total=None, loss="-", acc="-")

        def update(p: dict) -> None:
            acc = "-" if p["accuracy"] is None else f"{p['accuracy']:.1%}"
            total = p["step"] if p.get("done") else p["total"]  # stopping early fills the bar
            bar.update(task, completed=p["step"], total=total, loss=f"{p['loss']:.3f}", acc=acc)

        yield update


# --------------------------------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> None:
    from attnkit import bench

    compare = None
    if args.compare:
        try:
            compare = bench.load_json(args.compare)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise UsageError(
                f"{args.compare}: cannot read saved results ({type(e).__name__}: {_first_line(e)})"
            ) from None
    for option in (args.json, args.plot):
        if option:
            _writable_parent(Path(option))
    if args.plot and not args.plot.lower().endswith(".png"):
        raise UsageError(f"--plot {args.plot}: the file must end in .png")
    with _bench_progress() as on_row:
        report = bench.run(quick=args.quick, memory=not args.no_memory, on_row=on_row)
    header, rows = bench.table(report, compare)
    _table(rows, header, title=None)
    print(
        f"float32 matmul {report.matmul_gflops:.0f} GFLOP/s, {report.threads} threads, torch {report.torch_version},"
        f" {report.seconds:.0f} s"
    )
    checks = bench.targets(report)
    if checks:
        met = [
            [t.what, f"{t.measured:.2f}", ("<= " if t.at_most else ">= ") + f"{t.limit:.2f}", "yes" if t.met else "NO"]
            for t in checks
        ]
        print()
        _table(met, ("target", "measured", "limit", "met"), title=None)
    if args.json:
        bench.save_json(report, args.json)
        print(args.json)
    if args.plot:
        bench.plot_report(report, args.plot)
        print(args.plot)


def _writable_parent(path: Path) -> None:
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{path}: {str(path.parent)!r} is not a folder")
    if not path.parent.is_dir():
        raise UsageError(f"{path}: folder {str(path.parent)!r} does not exist")


@contextmanager
def _bench_progress() -> Iterator[Callable[[int, int, Any], None]]:
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda i, n, row: print(f"  [{i + 1}/{n}] {row.kind} L={row.L} {row.mode} {row.mask} {row.contender}")
        return
    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("benchmark", total=None)

        def update(i: int, n: int, row: Any) -> None:
            label = f"{row.kind} B={row.B} L={row.L} {row.mode} {row.mask} {row.contender}"
            bar.update(task, completed=i, total=n, description=label)

        yield update


# ---------------------------------------------------------------------------------------------------- main


def _table(rows: Sequence[Sequence[str]], header: Sequence[str], title: str | None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows] if any(header) else rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        return
    table = Table(title=title, show_header=any(header), box=None, pad_edge=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*r)
    Console(width=max(100, _terminal_width())).print(table)


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 140


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "info": cmd_info,
    "trace": cmd_trace,
    "heatmap": cmd_heatmap,
    "demo": cmd_demo,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        COMMANDS[args.command](args)
    except UsageError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnkit: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
