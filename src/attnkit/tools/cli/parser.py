"""The command line's arguments: one parser, whose types check every number when it is parsed (a mistake is a
:class:`~attnkit.tools.files.UsageError`: one line, exit 2)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import attnkit
from attnkit._validate import TORCH_SEEDS
from attnkit.tools.files import UsageError, cut, shown

__all__ = ["LARGEST", "build_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        if message.endswith("required: COMMAND"):  # `attnkit` alone: which commands there are, in the one line
            commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
            message += f" (one of {', '.join(commands.choices)}; attnkit COMMAND -h says more)"
        raise UsageError(message)


LARGEST = 100_000  # sizes the trace command builds tensors of; more is a typo, not a question about shapes


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``, said in one line otherwise."""
    kind = "a positive whole number" if low == 1 else "a whole number"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # also for more digits than int() reads
            raise argparse.ArgumentTypeError(
                f"invalid int value: {shown(text)}; expected {kind} from {low} to {high}"
            ) from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {cut(str(value))}")
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
                f"expected whole numbers separated by commas, like 3,2; got {shown(text)}"
            ) from None
        if not 0 <= lengths[-1] <= LARGEST:
            raise argparse.ArgumentTypeError(f"each length must be from 0 to {LARGEST}, got {cut(str(lengths[-1]))}")
    return lengths


def _heatmap_description() -> str:
    try:
        from attnkit.tools.plot import MAX_CELLS, MAX_PANELS
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
            "page says so. Or a statistics record, rec.save(FILE) after attnkit.record_stats: a page of per layer "
            "x head summaries and each query's strongest keys, at any length (--tokens and --example apply; "
            "--query-tokens, --key-tokens and --kv-heads are refused: the record knows its heads and positions)."
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
    d.add_argument(
        "--seed",
        type=_whole(*TORCH_SEEDS),
        default=None,
        help=f"{TORCH_SEEDS[0]} to {TORCH_SEEDS[1]}, as torch.manual_seed (default 0)",
    )
    d.add_argument("--quick", action="store_true", help="a smaller version, for tests")
    d.add_argument(
        "--smollm2",
        action="store_true",
        help="instead: what SmolLM2-135M-Instruct, a pretrained model installed offline, attends to (no training)",
    )
    b = commands.add_parser("bench", help="attnkit against torch.nn.MultiheadAttention and the book, one table")
    b.add_argument("--quick", action="store_true", help="a reduced grid (under a minute)")
    b.add_argument("--json", metavar="FILE", help="save the results (a .json file)")
    b.add_argument("--compare", metavar="FILE", help="show the change against results saved with --json")
    b.add_argument("--plot", metavar="FILE", help="a PNG of time and memory against L")
    b.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    return parser
