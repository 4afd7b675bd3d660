"""Applications built on attnkit's core: the command line (:mod:`~attnkit.tools.cli`), the offline viewer
(:mod:`~attnkit.tools.viewer`), pictures (:mod:`~attnkit.tools.plot`), the demo, the benchmark (``attnkit bench``)
and the book's own code they compare with (:mod:`~attnkit.tools.book`). Nothing in the core imports them; they
import the core.
"""
