"""The CPU fast path: numba kernels that read the caches' codes and 16-bit words in place.

numba_support (whether numba imported, threads, scratch buffers, numpy views), half_words (float16 and bfloat16
words), softmax (the row softmax they share), levels and vq_search (the codecs' scalar and vector searches in one
pass), block_attention (Shard's coded middle blocks), exact_parts (float, 8-bit and ring tokens), stream
(TurboQuant codes), encoders (TurboQuant codes written into the stream, a full ring's commit), step_parts (a
decode step's partials merged in one pass), lrqk_factor and lrqk_proxy (LRQK's factor update and selection),
warm_up (compiling them before anything is timed). Each keeps a torch reference path at its caller.
"""
