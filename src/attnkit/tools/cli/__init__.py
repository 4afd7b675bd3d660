"""The ``attnkit`` command (also ``python -m attnkit``).

    attnkit info                                  versions, threads, which backends run here (and why not)
    attnkit trace {dot,additive,multihead} [...]  the shape trace of a freshly built layer
    attnkit heatmap WEIGHTS_FILE --out FILE        draw weights saved with torch.save or numpy.save
    attnkit view WEIGHTS_FILE --out FILE.html      an interactive page of weights or a record (one HTML file)
    attnkit demo [--out DIR] [--seed N] [--quick]  the book's examples, then train two models and draw them
    attnkit demo --smollm2 [--out DIR]            what a pretrained model (SmolLM2-135M, offline) attends to
    attnkit bench [--quick] [--json F] [--compare F] [--plot F]   attnkit against torch and the book

A user mistake prints one line, ``attnkit: error: ...``, and exits with status 2; never a traceback. Every check
of the arguments happens before any work starts: numbers are whole numbers in a stated range when they are
parsed, files to read must be regular files, and every file or folder to write is checked by one helper
(:func:`output_file`, :func:`output_folder`: not a folder where a file is wanted, the right extension, an
existing folder that a probe file can be written into). Outputs appear whole or not at all: a picture or JSON file
is written to a temporary file beside it and renamed into place (``bench.save_json``, ``plot.save_figure``),
and the demo's pictures are drawn into a temporary folder, renamed into place (:func:`filling`), so a failure
leaves nothing behind that was not there before.
"""

from attnkit.tools.cli.commands import COMMANDS, main
from attnkit.tools.cli.parser import build_parser
from attnkit.tools.files import UsageError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]
