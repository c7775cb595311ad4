"""Device kernels (Triton) and the choice of code path; the lowest layer of kvshrink (imports nothing of it).

Every kernel here has a torch reference path elsewhere in kvshrink that is the oracle of its tests.
"""
