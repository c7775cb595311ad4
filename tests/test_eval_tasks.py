"""Evaluation harness without the real model: task generation, scoring, suites, CLI parsing, report."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from kvshrink.eval import data, report, scoring, tasks
from kvshrink.eval.cli import split_specs
from kvshrink.eval.runner import check_context, with_reference
from kvshrink.eval.suites import resolve_suite


class WordTokenizer:
    """A word-level tokenizer with a chat template: enough to test lengths and prompt contents."""

    eos_token_id = 1

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.words) + 10
            self.words.append(word)
        return self.vocab[word]

    def __call__(self, text: str, add_special_tokens: bool = False):
        return {"input_ids": [self._id(w) for w in re.findall(r"\S+|\n", text)]}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        words = (self.words[i - 10] if 10 <= i < len(self.words) + 10 else f"<{i}>" for i in ids)
        return " ".join(words).replace(" \n ", "\n")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<user>\n{m['content']}\n</user>\n" for m in messages)
        return text + ("<assistant>\n" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def builder():
    return tasks.Builder(WordTokenizer(), seed=0)


def prompt_text(b, sample):
    return b.tok.decode(sample.input_ids)


# -- scoring ----------------------------------------------------------------------------------

def test_needle_exact_needs_the_whole_number():
    assert scoring.needle_exact(" 1234567.", "1234567") == 100
    assert scoring.needle_exact("12345678", "1234567") == 0
    assert scoring.needle_exact("it is 7654321 or so", "1234567") == 0


def test_ruler_all_and_part():
    assert scoring.string_match_all("Alpha and beta", ["alpha", "beta", "gamma", "delta"]) == 50
    assert scoring.string_match_part("Alpha", ["alpha", "beta"]) == 100
    assert scoring.string_match_part("none", ["alpha", "beta"]) == 0
    with pytest.raises(ValueError):
        scoring.score_answer("fuzzy", "x", ["x"])


def test_distribution_agreement_is_kl_and_top1_share():
    import torch

    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), -1)
    assert scoring.distribution_agreement(ref, ref) == (0.0, 100.0)
    other = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [1.5, 1.0, 0.0]]), -1)
    kl, top1 = scoring.distribution_agreement(ref, other)
    p = ref[1].exp()
    assert kl == pytest.approx(float((p * (ref[1] - other[1])).sum()) / 2) and kl > 0
    assert top1 == 50.0
    with pytest.raises(ValueError, match="shape"):
        scoring.distribution_agreement(ref, ref[:1])


def test_free_running_kl_covers_the_steps_with_the_same_history():
    import torch

    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    other = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [1.5, 1.0, 0.0], [3.0, 0.0, 0.0]]), -1)
    step = [float((ref[i].exp() * (ref[i] - other[i])).sum()) for i in range(3)]
    assert scoring.free_running_kl(ref, other, None) == pytest.approx(sum(step) / 3)
    # differing at step 1: steps 0 and 1 shared their history, step 2 did not
    assert scoring.free_running_kl(ref, other, 1) == pytest.approx((step[0] + step[1]) / 2)
    assert scoring.free_running_kl(ref, other[:2], None) == pytest.approx((step[0] + step[1]) / 2)
    with pytest.raises(ValueError, match="step"):
        scoring.free_running_kl(ref, other[:0], None)


def test_token_agreement_counts_divergence_and_length():
    assert scoring.token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (100.0, None)
    assert scoring.token_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (75.0, 1)
    # stopping early is a difference, not agreement
    assert scoring.token_agreement([1, 2, 3, 4], [1, 2]) == (50.0, 2)


# -- text and needles -------------------------------------------------------------------------

def test_essays_are_found_and_cleaned():
    text = data.essay_corpus()
    assert len(text) > 500_000
    assert "\n" not in text and "  " not in text


def test_needle_goes_to_a_sentence_boundary_near_the_depth():
    text = " ".join(f"Sentence number {i} is here." for i in range(100))
    needle = "The special magic number for Oslo is: 1234567."
    for depth in (0.0, 0.25, 0.5, 1.0):
        out = data.insert_at_depth(text, needle, depth)
        pos = out.index(needle)
        assert abs(pos / len(text) - depth) < 0.03
        assert pos == 0 or out[pos - 2 : pos] == ". "
    with pytest.raises(ValueError):
        data.insert_at_depth(text, needle, 1.5)


def test_fit_to_length_lands_close_below_the_target():
    build = lambda n: (list(range(3 * n + 7)), [])  # noqa: E731
    ids, _ = tasks.fit_to_length(build, 1000, guess=10)
    assert 990 <= len(ids) <= 1000
    with pytest.raises(ValueError, match="too short"):
        tasks.fit_to_length(build, 5, guess=1)


# -- task samples -----------------------------------------------------------------------------

@pytest.mark.parametrize("length", [600, 2000])
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_niah_prompt_has_the_length_the_needle_and_the_question_last(builder, length, depth):
    s = builder.niah(length, depth)
    assert 0.97 * length <= len(s.input_ids) <= length
    text = prompt_text(builder, s)
    value = s.expected[0]
    assert re.fullmatch(r"\d{7}", value)
    assert text.count(value) == 1
    needle_at = text.index(value) / len(text)
    question_at = text.rindex("What is the special magic number")
    assert text.index(value) < question_at
    assert abs(needle_at - depth / 100 * question_at / len(text)) < 0.1


def test_samples_are_reproducible_from_the_seed():
    b1, b2 = tasks.Builder(WordTokenizer(), seed=1), tasks.Builder(WordTokenizer(), seed=2)
    assert b1.niah(800, 50).expected == tasks.Builder(WordTokenizer(), seed=1).niah(800, 50).expected
    assert b1.niah(800, 50).expected != b2.niah(800, 50).expected
    assert b1.niah(800, 50.0).input_ids == b1.niah(800, 50).input_ids   # --depths 50 is the suite's depth 50


@pytest.mark.parametrize("subtask", tasks.RULER_SUBTASKS)
def test_ruler_prompts_hold_every_expected_answer(builder, subtask):
    s = builder.ruler(subtask, 1500)
    assert 0.95 * 1500 <= len(s.input_ids) <= 1500
    text = prompt_text(builder, s)
    assert s.metric == "all" and s.expected
    for answer in s.expected:
        assert answer in text


def test_ruler_multikey_has_distractors_and_one_asked_key(builder):
    s = builder.ruler("niah_multikey", 1500)
    text = prompt_text(builder, s)
    assert len(re.findall(r"special magic number for \w+ is: \d{7}", text)) == 4
    assert len(s.expected) == 1


def test_cwe_common_words_are_the_most_frequent(builder):
    s = builder.ruler("cwe", 2000)
    listing = prompt_text(builder, s).split("most often.")[1].split("Question:")[0]
    counts = Counter(re.findall(r"\d+\. (\S+)", listing))
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.expected)
    assert min(counts[w] for w in s.expected) > max(c for w, c in counts.items() if w not in s.expected)


def test_fwe_top_three_are_strictly_ordered(builder):
    s = builder.ruler("fwe", 2000)
    body = prompt_text(builder, s).split("coded words.")[1].split("Question:")[0]
    counts = Counter(w for w in body.split() if w != "...")
    ranked = counts.most_common(4)
    assert [w for w, _ in ranked[:3]] == s.expected
    assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


def test_vt_chain_links_every_expected_variable(builder):
    s = builder.ruler("vt", 1500)
    text = prompt_text(builder, s)
    first, *rest = s.expected
    assert re.search(rf"VAR {first} = \d+", text)
    for prev, name in zip(s.expected, rest):
        assert f"VAR {name} = VAR {prev}" in text


def test_unknown_subtask_and_domain_are_refused(builder):
    with pytest.raises(ValueError, match="allowed"):
        builder.ruler("qa", 1000)
    with pytest.raises(ValueError, match="allowed"):
        builder.agreement("poetry", 500)


def test_ppl_sample_continues_the_prefix(builder):
    s = builder.ppl(700)
    assert len(s.input_ids) == 700 and len(s.target_ids) == builder.ppl_tokens
    assert s.input_ids + s.target_ids == builder.corpus.ids[: 700 + builder.ppl_tokens]


@pytest.mark.parametrize("domain", tasks.AGREEMENT_DOMAINS)
def test_agreement_prompts_fit_their_length(builder, domain):
    s = builder.agreement(domain, 500)
    assert 0.9 * 500 <= len(s.input_ids) <= 500
    if domain == "code":
        assert re.search(r"\n *(def|class) ", prompt_text(builder, s))


def test_context_check_names_the_largest_length(builder):
    suite = resolve_suite("quick", ["niah"])
    s = builder.niah(600, 50)
    with pytest.raises(ValueError, match="use lengths up to 584"):
        check_context([s], suite, max_positions=600)


# -- suites and CLI parsing -------------------------------------------------------------------

def test_suite_overrides_and_errors():
    suite = resolve_suite("standard", ["niah", "agreement"], lengths=[1000], depths=[0, 100], samples=2)
    assert set(suite.tasks) == {"niah", "agreement"}
    assert suite.tasks["niah"].lengths == (1000,) and suite.tasks["niah"].depths == (0, 100)
    assert suite.tasks["agreement"].lengths == (1024,)  # agreement keeps its short prompts
    with pytest.raises(ValueError, match="unknown task"):
        resolve_suite("quick", ["nia"])
    with pytest.raises(ValueError, match="unknown subtask"):
        resolve_suite("quick", ["ruler"], subtasks=["niah_single"])
    with pytest.raises(ValueError, match="belongs to ruler"):
        resolve_suite("quick", ["ruler"], subtasks=["prose"])
    picked = resolve_suite("quick", None, subtasks=["niah_single_noise", "code"])
    assert picked.tasks["ruler"].subtasks == ("niah_single_noise",)
    assert picked.tasks["agreement"].subtasks == ("code",)
    with pytest.raises(ValueError, match="unknown suite"):
        resolve_suite("huge")
    with pytest.raises(ValueError, match="depths"):
        resolve_suite("quick", depths=[120])


def test_method_specs_split_with_their_options():
    assert split_specs("full,shard:stream_bits=4,window=32,lrqk:top_k=256") == [
        "full", "shard:stream_bits=4,window=32", "lrqk:top_k=256"]
    assert with_reference(["streaming", "full"]) == ["full", "streaming"]
    with pytest.raises(ValueError):
        split_specs("window=3,full")


# -- report -----------------------------------------------------------------------------------

def fake_rows():
    rows = []
    for spec, good, ratio in (("full", 100, 0.5), ("streaming:window=64", 40, 6.0)):
        for L in (512, 1024):
            for depth in (0, 50, 100):
                rows.append({"spec": spec, "task": "niah", "subtask": "essay", "length": L, "depth": depth,
                             "sample": 0, "score": good if depth else 100, "ratio": ratio})
            rows.append({"spec": spec, "task": "ppl", "subtask": "essay", "length": L, "depth": None,
                         "sample": 0, "ppl": 10.0, "ppl_ratio": 1.0 if spec == "full" else 1.5, "ratio": ratio})
            rows.append({"spec": spec, "task": "cost", "subtask": "prefill+decode", "length": L, "depth": None,
                         "sample": 0, "nbytes": L * 1000 / ratio, "ratio": ratio, "prefill_s": 1.0,
                         "decode_ms_per_token": 50.0, "decode_ratio": 1.0 if spec == "full" else 1.2,
                         "peak_rss_delta_mb": 30.0})
    return rows


def test_report_writes_table_csv_and_plots(tmp_path):
    with open(tmp_path / "rows.jsonl", "w") as fh:
        for row in fake_rows():
            fh.write(json.dumps(row) + "\n")
    text = report.write_report(str(tmp_path))
    line = next(l for l in text.splitlines() if l.startswith("| streaming"))
    assert "| 60.0 |" in line and "1.500" in line and "6.00x" in line and "1.20" in line
    for name in ("results.csv", "summary.md", "niah_full.png", "niah_streaming_window_64.png", "pareto.png",
                 "cost_vs_length.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_report_refuses_an_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="no result rows"):
        report.write_report(str(tmp_path))


def test_pareto_front_keeps_undominated_points():
    assert report.pareto_front([(1, 100), (4, 80), (3, 70), (8, 20)]) == [(1, 100), (4, 80), (8, 20)]
