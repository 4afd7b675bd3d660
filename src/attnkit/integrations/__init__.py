"""attnkit inside other libraries' models, and other libraries' attention APIs on attnkit. An integration with a
library beyond torch is imported on its own (``import attnkit`` imports none of them, nor the library):

* :mod:`attnkit.integrations.transformers`: attnkit as an attention implementation of Hugging Face ``transformers``.
* :mod:`attnkit.integrations.torch_flex`, :mod:`~attnkit.integrations.flex_patch`,
  :mod:`~attnkit.integrations.torch_varlen`: torch's ``flex_attention`` and ``varlen_attn`` on the CPU with backward
  (:func:`attnkit.flex_attention`, :func:`attnkit.patch_flex_attention`, :func:`attnkit.varlen_attn`; torch alone,
  imported by ``attnkit``).
"""
