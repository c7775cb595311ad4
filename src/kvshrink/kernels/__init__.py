"""Device kernels (Triton), the CPU's numba kernels (``kernels.cpu``) and the choice of code path: above ``codecs``
(whose tensors they read), below ``cache`` and ``methods`` (imports nothing of them).

Every kernel here has a torch reference path elsewhere in kvshrink that is the oracle of its tests.
"""
