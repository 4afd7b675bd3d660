"""attnkit inside other libraries' models. Each integration is imported on its own (``import attnkit`` imports none
of them, nor the library it integrates with):

* :mod:`attnkit.integrations.transformers`: attnkit as an attention implementation of Hugging Face ``transformers``.
"""
