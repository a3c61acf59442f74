"""latentspeed's kernel core: Triton kernels with a plain-PyTorch reference beside each one.

Engine-independent: nothing here imports vLLM or SGLang. Families live in subpackages
(``mla``); each exposes ``is_supported(...) -> (bool, reason)`` so that every engine adapter
refuses an unsupported configuration with the same words. With ``TRITON_INTERPRET=1`` set
before import, the kernels run on the CPU through Triton's interpreter.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpreter import patch_interpreter

    patch_interpreter()
