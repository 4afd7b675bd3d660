"""What ``attnkit demo`` shows: the book's examples replayed with :mod:`attnkit.d2l`, then pictures of what the
trained models attend to (heatmaps, training curves, a viewer page per model)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from attnkit.tools.demo import DemoResult

__all__ = ["PICTURES", "draw", "replay_book_examples"]

KINDS = ("additive", "multihead")
# The files draw() writes: a heatmap per kind, the training curves, then a viewer page per kind.
PICTURES = (
    *(f"{kind}-attention.png" for kind in KINDS),
    "training.png",
    *(f"{kind}-attention.html" for kind in KINDS),
)


def replay_book_examples(echo: Callable[[str], None], seed: int = 0) -> None:
    """Run the examples of the book's attention chapters with :mod:`attnkit.d2l` and ``echo`` what they give."""
    from attnkit import d2l
    from attnkit.trace import trace_shapes

    with torch.random.fork_rng(devices=[]), _print_options(precision=4, sci_mode=False):
        torch.manual_seed(seed)
        echo("The book's examples, with attnkit.d2l")
        echo("\nmasked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3])): zeros past each length")
        echo(str(d2l.masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3]))))
        echo("\nmasked_softmax(torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]])): one length per query")
        echo(str(d2l.masked_softmax(torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]]))))
        echo("\nmasked_softmax(torch.rand(2, 2, 4), torch.tensor([0, 4])): a row with nothing to attend to is zero")
        echo(str(d2l.masked_softmax(torch.rand(2, 2, 4), torch.tensor([0, 4]))))

        keys = torch.ones((2, 10, 2))
        values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
        lens = torch.tensor([2, 6])
        additive = d2l.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
        with torch.no_grad():
            out = additive(torch.normal(0, 1, (2, 1, 20)), keys, values, lens)
        echo("\nAdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1), valid_lens [2, 6]:")
        echo(str(out))
        echo("attention_weights:\n" + str(additive.attention_weights))
        dot = d2l.DotProductAttention(dropout=0.5).eval()
        with torch.no_grad():
            out = dot(torch.normal(0, 1, (2, 1, 2)), keys, values, lens)
        echo("\nDotProductAttention(dropout=0.5), same keys, values and valid_lens:")
        echo(str(out))

        mha = d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
        X, Y = torch.ones((2, 4, 100)), torch.ones((2, 6, 100))
        with torch.no_grad(), trace_shapes() as steps:
            out = mha(X, Y, Y, torch.tensor([3, 2]))
        echo(f"\nMultiHeadAttention(100, 100, 100, 100, 5, 0.5) on (2, 4, 100) and (2, 6, 100) -> {tuple(out.shape)}:")
        echo(str(steps))


def draw(results: dict[str, DemoResult], out_dir: Path) -> list[Path]:
    """Heatmaps of what each model attends to, the loss curves, and a viewer page of every attention call of each
    model on its example (:func:`attnkit.tools.viewer.view`), written into ``out_dir``. Returns the paths."""
    from attnkit.tools import plot, viewer

    paths = []
    for kind, result in results.items():
        ex = result.example
        source = "".join(str(d) for d in ex["source"])
        title = f"{kind}: {source} -> {''.join(str(d) for d in ex['prediction'])}"
        path = out_dir / PICTURES[KINDS.index(kind)]
        plot.plot_attention(
            ex["weights"],
            query_labels=ex["target_labels"],
            key_labels=ex["source_labels"],
            path=path,
            title=title,
            xlabel="source",
            ylabel="output",
        )
        paths.append(path)

    plt = plot._pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
    for kind, result in results.items():
        ax_loss.plot([s for s, _ in result.losses], [loss for _, loss in result.losses], label=kind)
        ax_acc.plot([s for s, _ in result.accuracies], [a for _, a in result.accuracies], marker=".", label=kind)
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_acc.set(xlabel="step", ylabel="exact-sequence accuracy", ylim=(0, 1.01), title="held-out accuracy")
    ax_acc.legend()
    path = out_dir / "training.png"
    plot.save_figure(fig, path)
    paths.append(path)

    for kind, result in results.items():
        ex = result.example
        source = "".join(str(d) for d in ex["source"])
        path = out_dir / f"{kind}-attention.html"
        viewer.view(
            ex["record"],
            layer_tokens=ex["layer_tokens"],
            title=f"attnkit demo, {kind}: {source} -> {''.join(str(d) for d in ex['prediction'])}",
            path=path,
        )
        paths.append(path)
    return paths


@contextlib.contextmanager
def _print_options(**options: Any) -> Iterator[None]:
    """Print tensors with ``options`` inside; back to PyTorch's defaults after (the demo runs as a command)."""
    torch.set_printoptions(**options)
    try:
        yield
    finally:
        torch.set_printoptions(profile="default")
