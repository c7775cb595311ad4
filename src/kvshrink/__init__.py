"""kvshrink: shrink the KV cache of transformers language models.

    model, tokenizer = kvshrink.load_model()
    cache = kvshrink.make_cache("shard", model)
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    cache.compression_ratio()
    cache.save("doc.kvs"); cache = kvshrink.load_cache("doc.kvs", model); question_cache = cache.fork()
"""

# Import the methods package first: loading a submodule binds it as an attribute of its parent, so
# importing it later (methods(), or `import kvshrink.methods.h2o`) would replace the methods() function.
import kvshrink.methods  # noqa: E402,F401  (registers the built-in methods)
from kvshrink.cache import CacheReuseError, KVShrinkCache, make_cache, methods, parse_method_spec
from kvshrink.cache.persist import CacheFileError, load_cache
from kvshrink.methods.shard.sensitivity import calibrate_shard
from kvshrink.models import describe_model, load_model
from kvshrink.store import CacheStore

__version__ = "0.1.0"

__all__ = ["CacheFileError", "CacheReuseError", "CacheStore", "KVShrinkCache", "calibrate_shard", "describe_model", "load_cache", "load_model",
           "make_cache", "methods", "parse_method_spec", "__version__"]
