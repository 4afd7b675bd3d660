"""The ``attnkit`` command (also ``python -m attnkit``).

    attnkit info                                  versions, threads, which backends run here (and why not)
    attnkit trace {dot,additive,multihead} [...]  the shape trace of a freshly built layer
    attnkit heatmap WEIGHTS_FILE --out FILE        draw weights saved with torch.save or numpy.save
    attnkit view WEIGHTS_FILE --out FILE.html      an interactive page of weights or a record (one HTML file)
    attnkit demo [--out DIR] [--seed N] [--quick]  the book's examples, then train two models and draw them
    attnkit bench [--quick] [--json F] [--compare F] [--plot F]   attnkit against torch and the book

A user mistake prints one line, ``attnkit: error: ...``, and exits with status 2; never a traceback. Every check
of the arguments happens before any work starts: numbers are whole numbers in a stated range when they are
parsed, files to read must be regular files, and every file or folder to write is checked by one helper
(:func:`_output_file`, :func:`_output_folder`: not a folder where a file is wanted, the right extension, an
existing folder that a probe file can be written into). Outputs appear whole or not at all: a picture or JSON file
is written to a temporary file beside it and renamed into place (``bench.save_json``, ``plot.save_figure``),
and the demo's pictures are drawn into a temporary folder, renamed into place (:func:`_filling`), so a failure
leaves nothing behind that was not there before.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

import attnkit
from attnkit import dispatch
from attnkit.demo import SEEDS


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


LARGEST = 100_000  # sizes the trace command builds tensors of; more is a typo, not a question about shapes
TRACE_ELEMENTS = 2**26  # the largest tensor the trace command builds (256 MiB of float32): shapes show at any size
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")


def _short(text: str) -> str:
    """``text`` cut short for an error message when it is long (a pasted number of a thousand digits)."""
    return text if len(text) <= 40 else text[:37] + "..."


def _shown(text: str) -> str:
    return repr(_short(text))


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``, said in one line otherwise."""
    kind = "a positive whole number" if low == 1 else "a whole number"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also for more digits than int() reads
            raise argparse.ArgumentTypeError(
                f"invalid int value: {_shown(text)}; expected {kind} from {low} to {high}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {_short(str(value))}")
        return value

    return parse


_positive = _whole(1, LARGEST)
_length = _whole(0, LARGEST)


def _lengths(text: str) -> list[int]:
    if not text.strip():
        return []
    parts = text.split(",")
    if len(parts) > LARGEST:
        raise argparse.ArgumentTypeError(f"expected at most {LARGEST} lengths, got {len(parts)}")
    lengths = []
    for part in parts:
        try:
            lengths.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected whole numbers separated by commas, like 3,2; got {_shown(text)}"
            ) from None
        if not 0 <= lengths[-1] <= LARGEST:
            raise argparse.ArgumentTypeError(f"each length must be from 0 to {LARGEST}, got {_short(str(lengths[-1]))}")
    return lengths


def _heatmap_description() -> str:
    try:
        from attnkit.plot import MAX_CELLS, MAX_PANELS
    except ImportError:  # no numpy: the command says what to install when it runs
        return "Draw attention weights (needs attnkit[plot])."
    return (
        "Draw attention weights: (Lq, Lk), or (H, Lq, Lk) with one panel per head, or (rows, cols, Lq, Lk) as a "
        f"grid. At most {MAX_PANELS} panels (for more, save a selection, e.g. torch.save(w[:8, :8], 'part.pt')); "
        f"sides longer than {MAX_CELLS} are averaged in bins for display, and the figure's title says so. NaN and "
        "infinite entries are drawn grey."
    )


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
    t.add_argument(
        "--valid-lens", type=_lengths, default=[3, 2], help="one per example, like 3,2 ('' for none), 0 to 100000"
    )
    t.add_argument("--causal", action="store_true", help="add a causal mask")
    t.add_argument("--book", action="store_true", help="trace the attnkit.d2l class (the book's view)")
    t.add_argument("--format", choices=["text", "markdown", "json"], default="text")

    h = commands.add_parser(
        "heatmap",
        help="draw attention weights saved with torch.save or numpy.save",
        description=_heatmap_description(),
    )
    h.add_argument("weights_file", metavar="WEIGHTS_FILE")
    h.add_argument("--out", required=True, help="image file; the type follows the extension (png, svg, pdf, ...)")
    h.add_argument("--xlabel", default="keys")
    h.add_argument("--ylabel", default="queries")
    h.add_argument("--title", default=None)

    v = commands.add_parser(
        "view",
        help="an interactive page of attention weights: one self-contained HTML file",
        description=(
            "Write one HTML file (script, style and weights inside; it makes no request) with a head view, a model "
            "view and a matrix view. WEIGHTS_FILE: (Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk) weights saved with "
            "torch.save or numpy.save, or a record: torch.save({name: rec.calls(name) for name in rec}, FILE) "
            "after attnkit.record_weights. Large inputs are reduced (each row keeps its largest weights), and the "
            "page says so."
        ),
    )
    v.add_argument("weights_file", metavar="WEIGHTS_FILE")
    v.add_argument("--out", required=True, help="the page to write (.html)")
    tokens_help = "separated by spaces ('the cat sat'), or @FILE with one token per line"
    v.add_argument("--tokens", help=f"tokens of queries and keys (self-attention): {tokens_help}")
    v.add_argument("--query-tokens", help=f"tokens of the queries (cross-attention): {tokens_help}")
    v.add_argument("--key-tokens", help=f"tokens of the keys (cross-attention): {tokens_help}")
    v.add_argument("--kv-heads", type=_positive, default=None, help="key/value heads (grouped-query attention)")
    v.add_argument("--example", type=_length, default=0, help="the row of a record's batch to show (default 0)")
    v.add_argument("--title", default=None, help="the page's title (default: the file's name)")

    d = commands.add_parser("demo", help="the book's examples, then train two models and draw what they learned")
    d.add_argument(
        "--out",
        default="attnkit-demo",
        help="folder for the pictures, made when they are drawn (default: ./attnkit-demo)",
    )
    d.add_argument("--seed", type=_whole(*SEEDS), default=0, help=f"{SEEDS[0]} to {SEEDS[1]}, as torch.manual_seed")
    d.add_argument("--quick", action="store_true", help="a smaller version, for tests")
    b = commands.add_parser("bench", help="attnkit against torch.nn.MultiheadAttention and the book, one table")
    b.add_argument("--quick", action="store_true", help="a reduced grid (under a minute)")
    b.add_argument("--json", metavar="FILE", help="save the results (a .json file)")
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
        _table([(r[0], r[1], r[2], "-> " + r[3], r[4]) for r in t.rows()], header, title=None)


def _check_trace_sizes(args: argparse.Namespace, q_size: int, k_size: int) -> None:
    """Refuse sizes whose largest tensor would pass :data:`TRACE_ELEMENTS`, before building anything: each size
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
    _require("heatmap", "numpy", "matplotlib")
    from attnkit import plot

    source = _input_file(args.weights_file, "WEIGHTS_FILE")
    out = _output_file(args.out, "--out", IMAGE_SUFFIXES)
    weights = _load_weights(source)
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
        raise UsageError(f"{source}: cannot draw these weights: {_one_line(e)}") from None
    except OSError as e:  # the disk filled up, the folder went away: plot.save_figure left nothing behind
        raise UsageError(f"--out {out}: cannot write ({e.strerror or _one_line(e)})") from None
    print(out)


def _load_weights(path: Path, *, record: bool = False) -> Any:
    """The tensor in ``path`` (``.npy``, or anything else as ``torch.save``'s), as float32; with ``record``, also a
    record saved as ``{module name: tensor or list of tensors}`` (each checked the same way)."""
    try:
        if path.suffix == ".npy":
            import numpy as np

            array = np.load(path, allow_pickle=False)
            if array.dtype.byteorder not in ("=", "|"):  # a big-endian file: torch takes native byte order only
                array = array.astype(array.dtype.newbyteorder("="))
            data: Any = torch.from_numpy(array)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any reader failure is the file's fault here, said in one line
        raise UsageError(
            f"{path}: cannot read weights: not a tensor saved with torch.save or an array saved with numpy.save"
            f" ({type(e).__name__})"
        ) from None
    if record and isinstance(data, dict):
        if not data:
            raise UsageError(f"{path}: the record holds no layers (an empty dict)")
        loaded = {}
        for name, value in data.items():
            if not isinstance(name, str):
                raise UsageError(f"{path}: a record's keys are module names (strings), got {_shown(repr(name))}")
            calls = value if isinstance(value, (list, tuple)) else [value]
            if not calls:
                raise UsageError(f"{path}: layer {_shown(name)} has no calls (an empty list)")
            loaded[name] = [_weights_tensor(path, c, f"layer {_shown(name)}: ") for c in calls]
        return loaded
    if not isinstance(data, torch.Tensor):
        wanted = "one tensor or array of weights" + (", or a dict {layer name: tensors}" if record else "")
        raise UsageError(f"{path}: expected {wanted}, got a {type(data).__name__}")
    return _weights_tensor(path, data, "")


def _weights_tensor(path: Path, data: Any, where: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise UsageError(f"{path}: {where}expected a tensor of weights, got a {type(data).__name__}")
    if data.layout != torch.strided or data.device.type != "cpu":
        raise UsageError(
            f"{path}: {where}weights must be a dense tensor of numbers, got a {data.layout} tensor on {data.device} "
            f"(save weights.to_dense().cpu())"
        )
    if not (data.is_floating_point() or data.dtype in (torch.int32, torch.int64)):
        raise UsageError(f"{path}: {where}weights must be real numbers, got dtype {data.dtype}")
    if data.numel() == 0:
        raise UsageError(f"{path}: {where}the weights are empty, shape {tuple(data.shape)}")
    return data.float()


# ---------------------------------------------------------------------------------------------------- view


def cmd_view(args: argparse.Namespace) -> None:
    _require("view", "numpy")
    from attnkit import viewer

    source = _input_file(args.weights_file, "WEIGHTS_FILE")
    out = _output_file(args.out, "--out", (".html", ".htm"))
    tokens, query_tokens, key_tokens = (
        None if text is None else _tokens(text, option)
        for text, option in (
            (args.tokens, "--tokens"),
            (args.query_tokens, "--query-tokens"),
            (args.key_tokens, "--key-tokens"),
        )
    )
    weights = _load_weights(source, record=True)
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
        raise UsageError(f"{source}: {_one_line(e)}") from None
    except OSError as e:  # the disk filled up, the folder went away: nothing was left behind
        raise UsageError(f"--out {out}: cannot write ({e.strerror or _one_line(e)})") from None
    print(out)


def _tokens(text: str, option: str) -> list[str]:
    """Tokens from the command line: separated by white space, or ``@FILE``, one token per line (UTF-8)."""
    if not text.startswith("@"):
        return text.split()
    path = _input_file(text[1:], option)
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{option} {_shown(text)}: cannot be read as UTF-8 text ({type(e).__name__})") from None


# ---------------------------------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> None:
    _require("demo", "numpy", "matplotlib")  # before training, not when the pictures are drawn
    from attnkit import demo

    out_dir = _output_folder(args.out, "--out")
    for name in demo.PICTURES:  # before training: a name taken by a folder would only fail at the end
        taken = out_dir / name
        if _taken_by_other_than_a_file(taken):
            raise UsageError(f"--out {out_dir}: {str(taken)!r} exists and is not a file; the demo writes {name} there")
    demo.replay_book_examples(print)
    results = {}
    for kind in demo.KINDS:
        print(f"\nTraining the {kind} encoder-decoder to reverse digit sequences ...")
        with _progress(kind) as on_progress:
            results[kind] = demo.train(kind, seed=args.seed, quick=args.quick, on_progress=on_progress)
        r = results[kind]
        summary = f"{r.accuracy:.1%} exact-sequence accuracy on held-out sequences, {r.steps} steps"
        print(f"{kind}: {summary}, {r.seconds:.1f} s")
    try:
        with _filling(out_dir) as staging:
            names = [path.name for path in demo.draw(results, staging)]
    except OSError as e:  # the disk filled up, the folder went away: _filling left nothing new behind
        raise UsageError(f"--out {out_dir}: cannot write the pictures ({e.strerror or _one_line(e)})") from None
    print("\nPictures:")
    for name in names:
        print(f"  {out_dir / name}")


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
    if args.compare is not None:
        saved = _input_file(args.compare, "--compare")
        try:
            compare = bench.load_json(str(saved))
        except (OSError, ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep, not the structure
            raise UsageError(
                f"--compare {saved}: not results saved with `attnkit bench --json` ({_one_line(e)})"
            ) from None
    json_out = _output_file(args.json, "--json", (".json",)) if args.json is not None else None
    plot_out = _output_file(args.plot, "--plot", (".png",)) if args.plot is not None else None
    if plot_out is not None:
        _require("bench --plot", "numpy", "matplotlib")
    with _bench_progress() as on_row:
        report = bench.run(quick=args.quick, memory=not args.no_memory, on_row=on_row)
    header, rows = bench.table(report, compare)
    _table(rows, header, title=None)
    print(
        f"float32 matmul {report.matmul_gflops:.0f} GFLOP/s, {report.threads} threads, torch {report.torch_version},"
        f" {report.seconds:.0f} s"
    )
    for out, write in ((json_out, bench.save_json), (plot_out, bench.plot_report)):
        if out is not None:
            try:
                write(report, str(out))  # each writes whole or not at all (a temporary file, renamed into place)
            except OSError as e:
                raise UsageError(f"{out}: cannot write ({e.strerror or _one_line(e)})") from None
            print(out)


# ------------------------------------------------------------------------------------------ files and folders


def _require(command: str, *modules: str) -> None:
    """A one-line error naming the extra to install, before any work, when ``command`` needs a missing module."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            raise UsageError(f"{command} needs {module}: pip install 'attnkit[plot]'") from None


def _input_file(text: str, what: str) -> Path:
    """A file to read: it must exist and be a regular file (a folder or /dev/zero is a mistake, said at once)."""
    path = Path(text)
    try:
        if not text or not path.exists():
            raise UsageError(f"{text or repr(text)}: no such file")
        if path.is_dir():
            raise UsageError(f"{what} {text}: is a folder, not a file")
        if not path.is_file():
            raise UsageError(f"{what} {text}: is not a regular file")
    except OSError as e:  # a name too long, a folder that cannot be searched
        raise UsageError(f"{what} {_shown(text)}: cannot be read ({e.strerror or e})") from None
    return path


def _output_file(text: str, what: str, suffixes: Sequence[str]) -> Path:
    """Check, before any work starts, a file that the command will write (atomically, later).

    The same checks for every output: a name is given; it is not a folder, nor anything but a regular file; its
    extension is one of ``suffixes``; its folder exists, is a folder, and a probe file can be made in it (which
    also catches folders such as /proc, where even root cannot make a file). An existing file is replaced.
    """
    path = Path(text)
    try:
        if not text.strip():
            raise UsageError(f"{what}: the file name is empty")
        if path.is_dir() or text.endswith(os.sep):
            raise UsageError(f"{what} {text}: names a folder; name a file, such as {path / ('out' + suffixes[0])}")
        if path.exists() and not path.is_file():
            raise UsageError(f"{what} {text}: exists and is not a regular file")
        if path.suffix.lower() not in suffixes:
            kinds = ("one of " if len(suffixes) > 1 else "") + ", ".join(suffixes)
            raise UsageError(f"{what} {text}: the extension must be {kinds}")
        _writable_folder(path.parent, f"{what} {text}")
        _check_name_lengths(path, path.parent, f"{what} {_shown(text)}")
    except OSError as e:
        raise UsageError(f"{what} {_shown(text)}: cannot be written ({e.strerror or e})") from None
    return path


def _output_folder(text: str, what: str) -> Path:
    """Check, before any work starts, a folder that the command will fill: an existing folder that can be written
    into, or a new one whose nearest existing parent can be. Nothing is made here (see :func:`_filling`)."""
    path = Path(text)
    try:
        if not text.strip():
            raise UsageError(f"{what}: the folder name is empty")
        if path.exists() and not path.is_dir():
            raise UsageError(f"{what} {text}: cannot write there: it is a file, not a folder")
        nearest = path
        while not nearest.exists() and nearest != nearest.parent:
            if nearest.is_symlink():
                raise UsageError(f"{what} {text}: {str(nearest)!r} is a symbolic link to nothing")
            nearest = nearest.parent
        if not nearest.is_dir():
            raise UsageError(f"{what} {text}: cannot write there: {str(nearest)!r} is not a folder")
        _writable_folder(nearest, f"{what} {text}")
        _check_name_lengths(path, nearest, f"{what} {_shown(text)}")
    except OSError as e:
        raise UsageError(f"{what} {_shown(text)}: cannot write there ({e.strerror or e})") from None
    return path


def _check_name_lengths(path: Path, existing: Path, what: str) -> None:
    """Every name in ``path`` fits the file system of ``existing`` (its nearest existing folder): checked before any
    work, not found out when the output is written."""
    longest = os.pathconf(existing, "PC_NAME_MAX")
    for part in path.parts:
        if len(os.fsencode(part)) > longest:
            raise UsageError(
                f"{what}: the name {_shown(part)} is longer than this file system allows ({longest} bytes)"
            )


def _writable_folder(folder: Path, what: str) -> None:
    if not folder.exists():
        raise UsageError(f"{what}: folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise UsageError(f"{what}: {str(folder)!r} is not a folder")
    try:  # os.access says yes to root everywhere, /proc included: making a file is the honest test
        fd, probe = tempfile.mkstemp(prefix=".attnkit-", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{what}: cannot write into folder {str(folder)!r} ({e.strerror or e})") from None


@contextmanager
def _filling(folder: Path) -> Iterator[Path]:
    """A fresh temporary folder to write into; when the block succeeds, what it holds moves into ``folder``.

    A missing ``folder`` (and its missing parents) is made only then, and appears whole: the temporary folder,
    made beside it, is renamed into place. An existing ``folder`` gets the files one by one, each renamed in from
    a temporary folder inside it. When the block fails, the temporary folder and any parent made here are removed,
    so a failed run leaves nothing new behind.
    """
    missing = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
    made: list[Path] = []
    try:
        for parent in reversed(missing[1:]):
            parent.mkdir()
            made.append(parent)
        # a fresh name made with mkdir, so that it gets the mode the umask gives (mkdtemp's is private)
        staging = (folder.parent if missing else folder) / f".attnkit-{uuid.uuid4().hex[:12]}.part"
        staging.mkdir()
        try:
            yield staging
            if missing:
                os.replace(staging, folder)
            else:
                _move_all(staging, folder)
                staging.rmdir()
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException:
        for parent in reversed(made):  # the innermost first; only folders still empty
            with suppress(OSError):
                parent.rmdir()
        raise


def _taken_by_other_than_a_file(path: Path) -> bool:
    """A folder, a link to nothing or a device where a file is to go: replacing it would fail or do harm."""
    return (path.exists() or path.is_symlink()) and not path.is_file()


def _move_all(staging: Path, folder: Path) -> None:
    """Move what ``staging`` holds into ``folder``, all or nothing: names that exist there as anything but a file
    stop it before anything moves; files it replaces are kept aside and put back if a later move fails."""
    items = sorted(staging.iterdir())
    for item in items:
        target = folder / item.name
        if _taken_by_other_than_a_file(target):
            raise UsageError(f"{target}: exists and is not a regular file; nothing was written into {str(folder)!r}")
    kept: list[tuple[Path, Path]] = []  # (target, its previous version, set aside in staging)
    moved: list[Path] = []
    try:
        for item in items:
            target = folder / item.name
            if target.exists():
                old = staging / f".old-{item.name}"
                os.replace(target, old)
                kept.append((target, old))
            os.replace(item, target)
            moved.append(target)
    except BaseException:
        for target in moved:
            with suppress(OSError):
                target.unlink()
        for target, old in kept:
            with suppress(OSError):
                os.replace(old, target)
        raise
    for _, old in kept:
        old.unlink()


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


def _one_line(e: BaseException, limit: int = 300) -> str:
    """The whole message of ``e`` on one line (matplotlib's start with a blank line), its type when empty."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {
    "info": cmd_info,
    "trace": cmd_trace,
    "heatmap": cmd_heatmap,
    "view": cmd_view,
    "demo": cmd_demo,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
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
        print(f"attnkit: error: cannot write the output ({e.strerror or _one_line(e)})", file=sys.stderr)
        return 1
    return 0


def _drop_stdout() -> None:
    """Python would flush stdout again at exit, and complain: point it at devnull first."""
    with suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
