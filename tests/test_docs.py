"""The documents that are derived from the code stay in step with it."""

from pathlib import Path

from kvshrink.cache.registry import options_markdown

ROOT = Path(__file__).resolve().parents[1]


def test_options_doc_is_generated_from_the_declared_options():
    doc = (ROOT / "docs" / "options.md").read_text()
    assert doc == options_markdown(), "docs/options.md is stale: run `kvshrink methods --markdown > docs/options.md`"


def test_every_method_and_option_is_in_the_options_doc():
    import kvshrink

    doc = (ROOT / "docs" / "options.md").read_text()
    for name, info in kvshrink.methods().items():
        if not info.module.startswith("kvshrink."):
            continue  # e.g. the worked example registered by its test
        assert f"## `{name}`" in doc
        for opt in info.options:
            assert f"| `{opt}` |" in doc
