"""Task generation: every prompt is built locally from a seed and fitted to a length in tokens.

A *sample* is one prompt (or one perplexity text) with what a correct answer must contain. Samples
do not depend on the method, so one set of samples is built per run and shared by every method spec.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from . import data

TASKS = ("niah", "ruler", "ppl", "agreement", "cost")
RULER_SUBTASKS = (
    "niah_single_essay", "niah_single_noise", "niah_multikey", "niah_multivalue",
    "niah_multiquery", "vt", "cwe", "fwe",
)
# Answer budgets: enough for every expected item with the model's usual list formatting.
RULER_ANSWER_TOKENS = {
    "niah_single_essay": 16, "niah_single_noise": 16, "niah_multikey": 16, "niah_multivalue": 64,
    "niah_multiquery": 64, "vt": 48, "cwe": 96, "fwe": 32,
}
NIAH_ANSWER_TOKENS = 16
AGREEMENT_DOMAINS = ("prose", "code", "list", "dialogue", "arithmetic")

CITIES = (
    "Chicago", "Yangon", "Antananarivo", "Colombo", "Almaty", "Sydney", "Lima", "Oslo", "Dakar",
    "Hanoi", "Quito", "Tbilisi", "Nairobi", "Riga", "Montevideo", "Helsinki", "Ljubljana", "Kyoto",
    "Valencia", "Porto", "Tunis", "Bergen", "Cusco", "Hobart", "Tallinn", "Lusaka", "Accra",
    "Windhoek", "Bratislava", "Vilnius", "Asmara", "Manila", "Dublin", "Havana", "Kampala", "Zagreb",
)


@dataclass
class Sample:
    """One prompt of a task. ``metric``: exact | all | part (generation), ppl, agreement."""

    task: str
    subtask: str
    length: int
    depth: float | None
    index: int
    input_ids: list[int]
    expected: list[str]
    metric: str
    max_new_tokens: int
    target_ids: list[int] = field(default_factory=list)  # ppl: tokens scored after the prefix

    @property
    def key(self) -> tuple:
        return (self.task, self.subtask, self.length, self.depth, self.index)

    @property
    def positions_needed(self) -> int:
        return len(self.input_ids) + max(self.max_new_tokens, len(self.target_ids))


def sample_rng(seed: int, *parts) -> random.Random:
    # A str seed is hashed with SHA-512 by random.Random: stable across processes and Python runs.
    return random.Random(":".join(str(p) for p in (seed, *parts)))


# ---------------------------------------------------------------------------------------------
# prompts and fitting to a token length


def chat_ids(tokenizer, user_text: str, answer_prefix: str = "") -> list[int]:
    """The model's chat template with the question as the user turn, the answer prefix after the
    generation prompt (small instruct models answer far more reliably when the reply is started)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text + answer_prefix, add_special_tokens=False)["input_ids"]


Built = tuple[list[int], list[str]]


def fit_to_length(build: Callable[[int], Built], length: int, guess: int) -> Built:
    """Find the largest size ``n`` whose prompt ``build(n)`` has at most ``length`` tokens.

    Token counts are close to linear in ``n``; a few proportional steps then a short walk down
    land within a few tokens of the target.
    """
    best: Built | None = None
    best_n = 0
    n = max(1, guess)
    tried: dict[int, int] = {}
    for _ in range(8):
        if n in tried:
            break
        ids, expected = build(n)
        tried[n] = len(ids)
        if len(ids) <= length and n > best_n:
            best, best_n = (ids, expected), n
        if abs(len(ids) - length) <= max(2, length // 200) and len(ids) <= length:
            break
        n = max(1, int(n * length / max(1, len(ids))))
        if len(ids) > length:
            n = min(n, max(1, int(n * 0.99)))
    if best is None:
        ids, _ = build(1)
        raise ValueError(
            f"length {length} is too short for this task: its smallest prompt has {len(ids)} tokens"
        )
    return best


class TokenCorpus:
    """The essay corpus as token ids, so a haystack of exactly n tokens is a slice."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = tokenizer(data.essay_corpus(), add_special_tokens=False)["input_ids"]

    def text(self, n_tokens: int, start: int = 0) -> str:
        if n_tokens > len(self.ids):
            raise ValueError(f"the essay corpus has {len(self.ids)} tokens; {n_tokens} were asked for")
        return self.tokenizer.decode(self.ids[start : start + n_tokens])


def noise_text(n_repeats: int) -> str:
    return (data.NOISE_SENTENCES * n_repeats).strip()


def seven_digits(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def needle_sentence(city: str, value: str) -> str:
    return f"The special magic number for {city} is: {value}."


def insert_needles(haystack: str, needles: list[str], depths: list[float]) -> str:
    # Deepest first, so earlier insertions do not move the offsets of later ones.
    for needle, depth in sorted(zip(needles, depths), key=lambda p: -p[1]):
        haystack = data.insert_at_depth(haystack, needle, depth)
    return haystack


def niah_question(context: str, cities: list[str], plural: bool) -> tuple[str, str]:
    if plural:
        what = "all the special magic numbers for " + ", ".join(cities)
        prefix = f"The special magic numbers for {', '.join(cities)} mentioned in the provided text are"
    else:
        what = f"the special magic number for {cities[0]}"
        prefix = f"The special magic number for {cities[0]} mentioned in the provided text is"
    user = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "them. I will quiz you about the numbers afterwards.\n\n"
        f"{context}\n\nWhat is {what} mentioned in the provided text?"
    )
    return user, prefix


# ---------------------------------------------------------------------------------------------
# NIAH


class Builder:
    """Builds every sample of every task for one tokenizer and seed."""

    def __init__(self, tokenizer, seed: int = 0, max_new_tokens: int | None = None,
                 agreement_tokens: int = 128, ppl_tokens: int = 128):
        """``max_new_tokens`` overrides the NIAH/RULER answer budgets when given."""
        self.tok = tokenizer
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self.agreement_tokens = agreement_tokens
        self.ppl_tokens = ppl_tokens
        self._corpus: TokenCorpus | None = None

    @property
    def corpus(self) -> TokenCorpus:
        if self._corpus is None:
            self._corpus = TokenCorpus(self.tok)
        return self._corpus

    # -- NIAH --------------------------------------------------------------------------------
    def niah(self, length: int, depth_percent: float, index: int = 0) -> Sample:
        # 25 and 25.0 are the same depth: seed from one spelling so --depths 25 rebuilds the suite's prompt.
        depth_key = int(depth_percent) if float(depth_percent).is_integer() else float(depth_percent)
        rng = sample_rng(self.seed, "niah", length, depth_key, index)
        city, value = rng.choice(CITIES), seven_digits(rng)

        def build(n: int) -> Built:
            context = insert_needles(self.corpus.text(n), [needle_sentence(city, value)],
                                     [depth_percent / 100.0])
            user, prefix = niah_question(context, [city], plural=False)
            return chat_ids(self.tok, user, prefix), [value]

        ids, expected = fit_to_length(build, length, guess=length - 100)
        return Sample("niah", "essay", length, depth_percent, index, ids, expected, "exact",
                      self.max_new_tokens or NIAH_ANSWER_TOKENS)

    # -- RULER -------------------------------------------------------------------------------
    def ruler(self, subtask: str, length: int, index: int = 0) -> Sample:
        if subtask not in RULER_SUBTASKS:
            raise ValueError(f"unknown RULER subtask {subtask!r}; allowed: {', '.join(RULER_SUBTASKS)}")
        rng_seed = ("ruler", subtask, length, index)
        build, guess = getattr(self, "_ruler_" + subtask)(rng_seed, length)
        ids, expected = fit_to_length(build, length, guess)
        return Sample("ruler", subtask, length, None, index, ids, expected, "all",
                      self.max_new_tokens or RULER_ANSWER_TOKENS[subtask])

    def _niah_variant(self, rng_seed, length, n_needles: int, n_asked: int, same_key: bool,
                      noise: bool):
        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)  # same needles for every size n
            cities = rng.sample(CITIES, 1 if same_key else n_needles)
            keys = cities * n_needles if same_key else cities
            values = [seven_digits(rng) for _ in range(n_needles)]
            depths = [rng.uniform(0.05, 0.95) for _ in range(n_needles)]
            haystack = noise_text(n) if noise else self.corpus.text(n)
            context = insert_needles(haystack, [needle_sentence(k, v) for k, v in zip(keys, values)],
                                     depths)
            asked = keys[:1] if same_key else keys[:n_asked]
            user, prefix = niah_question(context, asked, plural=n_asked > 1 or same_key and n_needles > 1)
            expected = values if same_key else values[:n_asked]
            return chat_ids(self.tok, user, prefix), expected

        # noise: one repeat of the noise sentences is about 25 tokens
        return build, (length // 25 if noise else length - 150)

    def _ruler_niah_single_essay(self, s, length):
        return self._niah_variant(s, length, 1, 1, same_key=False, noise=False)

    def _ruler_niah_single_noise(self, s, length):
        return self._niah_variant(s, length, 1, 1, same_key=False, noise=True)

    def _ruler_niah_multikey(self, s, length):
        # one asked key, three distractor needles with other keys
        return self._niah_variant(s, length, 4, 1, same_key=False, noise=False)

    def _ruler_niah_multivalue(self, s, length):
        return self._niah_variant(s, length, 4, 1, same_key=True, noise=False)

    def _ruler_niah_multiquery(self, s, length):
        return self._niah_variant(s, length, 4, 4, same_key=False, noise=False)

    def _ruler_vt(self, rng_seed, length, hops: int = 4):
        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)
            names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                     for _ in range(hops + 1)]
            value = str(rng.randint(10000, 99999))
            chain = [f"VAR {names[0]} = {value}."] + [
                f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)
            ]
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            context = insert_needles(noise_text(n), chain, depths)
            user = (
                "Memorize and track the chain(s) of variable assignment hidden in the following "
                f"text.\n\n{context}\n\nQuestion: Find all variables that are assigned the value "
                f"{value} in the text above."
            )
            prefix = (
                "Answer: According to the chain(s) of variable assignment in the text above, "
                f"{hops + 1} variables are assigned the value {value}, they are:"
            )
            return chat_ids(self.tok, user, prefix), names

        return build, length // 25

    def _ruler_cwe(self, rng_seed, length, n_common: int = 10):
        freq_common = max(3, min(30, length // 256))

        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)
            pool = rng.sample(data.essay_words(), n_common + n)
            common, rare = pool[:n_common], pool[n_common:]
            words = common * freq_common + rare
            rng.shuffle(words)
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            user = (
                "Below is a numbered list of words. In these words, some appear more often than "
                f"others. Memorize the ones that appear most often.\n{listing}\nQuestion: What are "
                f"the {n_common} most common words in the above list?"
            )
            prefix = f"Answer: The top {n_common} words that appear most often in the list are:"
            return chat_ids(self.tok, user, prefix), common

        return build, max(1, length // 5 - n_common * freq_common)

    def _ruler_fwe(self, rng_seed, length, alpha: float = 2.0):
        def build(n: int) -> Built:
            # Counts fall as 1/rank^alpha from n: the top three are strictly ordered, never tied.
            rng = sample_rng(self.seed, *rng_seed)
            counts = []
            rank = 1
            while int(n / rank**alpha) >= 1 and rank <= 500:
                counts.append(int(n / rank**alpha))
                rank += 1
            vocab: list[str] = []
            while len(vocab) < len(counts):
                w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
                if w not in vocab:
                    vocab.append(w)
            words = [w for w, c in zip(vocab, counts) for _ in range(c)]
            rng.shuffle(words)
            user = (
                "Read the following coded text and track the frequency of each coded word. Find the "
                f"three most frequently appeared coded words. {' ... '.join(words)}\nQuestion: Do not "
                "provide any explanation. Please ignore the dots '...'. What are the three most "
                "frequently appeared words in the above coded text?"
            )
            prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
            return chat_ids(self.tok, user, prefix), vocab[:3]

        return build, max(4, length // 6)

    # -- perplexity --------------------------------------------------------------------------
    def ppl(self, length: int, index: int = 0) -> Sample:
        """An essay prefix of ``length`` tokens (no chat template: plain prose) and the next
        ``ppl_tokens`` tokens to score. Sample ``index`` starts at essay number ``index``."""
        start = self._essay_start(index)
        ids = self.corpus.ids
        end = start + length + self.ppl_tokens
        if end > len(ids):
            raise ValueError(f"the essay corpus is too short for a {length}-token perplexity prefix")
        return Sample("ppl", "essay", length, None, index, ids[start : start + length], [], "ppl", 0,
                      target_ids=ids[start + length : end])

    def _essay_start(self, index: int) -> int:
        if index == 0:
            return 0
        prefix = " ".join(data.essay(i) for i in range(index))
        return len(self.tok(prefix, add_special_tokens=False)["input_ids"])

    # -- decode agreement --------------------------------------------------------------------
    def agreement(self, domain: str, length: int, index: int = 0) -> Sample:
        if domain not in AGREEMENT_DOMAINS:
            raise ValueError(f"unknown agreement domain {domain!r}; allowed: {', '.join(AGREEMENT_DOMAINS)}")
        rng_seed = ("agreement", domain, length, index)
        build, guess = getattr(self, "_agree_" + domain)(rng_seed)
        ids, _ = fit_to_length(build, length, guess)
        return Sample("agreement", domain, length, None, index, ids, [], "agreement",
                      self.agreement_tokens)

    def _agree_prose(self, rng_seed):
        rng = sample_rng(self.seed, *rng_seed)
        start = rng.randrange(0, len(self.corpus.ids) // 2)

        def build(n: int) -> Built:
            text = self.corpus.text(n, start)
            return chat_ids(self.tok, "Continue this essay in the same style:\n\n" + text), []

        return build, 400

    def _agree_code(self, rng_seed):
        rng = sample_rng(self.seed, *rng_seed)
        modules = list(data.STDLIB_CODE_MODULES)
        rng.shuffle(modules)
        code_ids = self.tok("\n\n".join(data.stdlib_source(m) for m in modules),
                            add_special_tokens=False)["input_ids"]

        def build(n: int) -> Built:
            if n > len(code_ids):
                raise ValueError(f"the code prompt source has only {len(code_ids)} tokens")
            text = self.tok.decode(code_ids[:n])
            return chat_ids(self.tok, "Continue this Python code:\n\n" + text), []

        return build, 400

    def _agree_list(self, rng_seed):
        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)
            words = rng.sample(data.essay_words(), min(n, len(data.essay_words())))
            rows = "\n".join(f"{i + 1}. {w}: {rng.randint(1, 500)} units, shelf {rng.choice('ABCDEFGH')}"
                             for i, w in enumerate(words))
            return chat_ids(self.tok, "Here is a warehouse inventory list. Continue the list with "
                                      "more items in the same format:\n\n" + rows), []

        return build, 40

    def _agree_dialogue(self, rng_seed):
        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)
            start = rng.randrange(0, len(self.corpus.ids) // 2)
            sentences = self.corpus.text(40 * n + 200, start).split(". ")[1 : n + 1]
            lines = "\n".join(f"{'Alice' if i % 2 == 0 else 'Bob'}: {s.strip()}." for i, s in enumerate(sentences))
            return chat_ids(self.tok, "Here is a conversation between Alice and Bob. Continue it:\n\n"
                            + lines), []

        return build, 20

    def _agree_arithmetic(self, rng_seed):
        def build(n: int) -> Built:
            rng = sample_rng(self.seed, *rng_seed)
            rows = []
            for _ in range(n):
                a, b = rng.randint(10, 999), rng.randint(10, 999)
                op = rng.choice("+-")
                rows.append(f"{a} {op} {b} = {a + b if op == '+' else a - b}")
            return chat_ids(self.tok, "Here are some solved arithmetic problems. Write more problems "
                                      "and solve them in the same format:\n\n" + "\n".join(rows)), []

        return build, 50
