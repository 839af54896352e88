"""Built-in reward functions of the reward stage.

Pure functions, no I/O, no torch. Every reward maps one :class:`Sample` to a float;
:data:`REWARDS` is the registry the stage looks names up in, :func:`combine` sums the
weighted rewards named by specs such as ``"gsm8k:1.0"``.

Answer extraction rule (used by every accuracy reward): the completion is searched for
each format in ``formats``, in order; the first format that occurs at all wins, and the
LAST occurrence of that format is the final answer. The default order is
``answer_tag`` (``<answer>…</answer>``, the slot our prompt template asks for), then
``hash`` (GSM8K's ``#### n``; a ``####`` line whose text starts with a letter is a markdown
heading, not an answer), then ``boxed`` (MATH's ``\\boxed{…}``/``\\fbox{…}``, nested braces
allowed; "last" = the box that opens last, so ``\\boxed{\\boxed{5}}`` gives 5). ``last_number``
(the last number in the text, lm-eval's "flexible extract") exists but is off by default:
a completion without a marked answer earns no accuracy reward. If the winning occurrence
is empty (``\\boxed{}``, ``<answer> </answer>``) the answer is None; there is no fallback
to an earlier occurrence or a lower-priority format. A ``\\boxed{…}`` (or ``#### n``)
inside an answer tag is unwrapped. Unclosed tags/braces (truncated outputs) do not count.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping

__all__ = [
    "Sample", "RewardFn", "REWARDS", "DEFAULT_FORMATS", "DEFAULT_FORMAT_PATTERN",
    "THINK_OPENED_IN_PROMPT_PATTERN", "DEFAULT_REWARDS", "extract_answer", "normalize_number",
    "gsm8k_accuracy", "math_accuracy", "format_reward", "overlong_penalty", "truncated_flag",
    "parse_reward_spec", "combine",
]

DEFAULT_FORMATS: tuple[str, ...] = ("answer_tag", "hash", "boxed")

# ---------------------------------------------------------------------------- extraction
_ANSWER_TAG_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
# "#### Step 1: ..." is a markdown heading, not an answer: the content may not start with a letter.
_HASH_RE = re.compile(r"####[ \t]*+(?![^\W\d_])([^\n]*)")
_BOX_TOKEN_RE = re.compile(r"(\\(?:boxed|fbox)\s*\{)|\\.|[{}]", re.DOTALL)
_LAST_NUMBER_RE = re.compile(r"[-+\u2212]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?")


def _boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{…}`` in order of appearance (nested braces and
    escaped ``\\{ \\}`` handled; an unbalanced, i.e. truncated, box is skipped)."""
    # One linear pass (a degenerate "\boxed{\boxed{..." loop must not cost O(n^2)).
    found, open_boxes, depth = [], [], 0  # open_boxes: (content start, depth outside it)
    for m in _BOX_TOKEN_RE.finditer(text):
        tok = m.group()
        if m.group(1):
            open_boxes.append((m.end(), depth))
            depth += 1
        elif tok == "{":
            depth += 1
        elif tok == "}":
            depth -= 1
            if open_boxes and open_boxes[-1][1] == depth:
                start = open_boxes.pop()[0]
                found.append((start, text[start:m.start()]))
    return [content for _, content in sorted(found)]


def _candidates(text: str, fmt: str) -> list[str]:
    if fmt == "answer_tag":
        return _ANSWER_TAG_RE.findall(text)
    if fmt == "hash":
        return _HASH_RE.findall(text)
    if fmt == "boxed":
        return _boxed_contents(text)
    return _LAST_NUMBER_RE.findall(text)  # "last_number"; names are checked by the caller


def extract_answer(text: str, formats: Iterable[str] = DEFAULT_FORMATS) -> str | None:
    """The final answer of ``text`` by the module's extraction rule (see the module
    docstring): last occurrence of the highest-priority format present, stripped; None when
    no format occurs or the winning occurrence is empty. Raises ValueError on an unknown
    format name."""
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    unknown = set(formats) - {"answer_tag", "hash", "boxed", "last_number"}
    if unknown:
        raise ValueError(f"unknown answer format(s) {sorted(unknown)}; "
                         "known: answer_tag, hash, boxed, last_number")
    if not isinstance(text, str):
        return None
    for fmt in formats:
        found = _candidates(text, fmt)
        if not found:
            continue
        answer = found[-1].strip()
        if fmt in ("answer_tag", "hash"):
            inner = _boxed_contents(answer) or _HASH_RE.findall(answer)
            if inner:
                answer = inner[-1].strip()
        return answer or None
    return None


# ------------------------------------------------------------------------- normalization
_CURRENCY = "$€£¥₹"
_NUM = (r"(?:\d{1,3}(?:,\d{3})+|\d{1,3}(?:[ \u00a0\u2009\u202f]\d{3})+|\d+)(?:\.\d*)?"
        r"(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?")
_NUMBER_RE = re.compile(
    rf"(?P<s1>[-+]?)\s*[{_CURRENCY}]?\s*(?P<s2>[-+]?)\s*(?P<num>{_NUM})"
    rf"(?:\s*/\s*(?P<den>{_NUM}))?(?P<rest>.*)", re.DOTALL)
# What may follow the number: words/units, %, currency, degree, punctuation — no digits,
# no LaTeX commands, no operators (so "2\pi", "5 + x", "5, 6" are not numbers).
_REST_OK_RE = re.compile(rf"(?:[^\W\d_]|[\s%{_CURRENCY}°²³.,;:!?'\"/()])*")
_LATEX_SUBS = [
    (re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"\1/\2"),
    (re.compile(r"\\(?:text|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}"), r" \1 "),
    (re.compile(r"(?<=[^\W\d_])\^\s*\{?\s*[23]\s*\}?|\^\s*\{?\s*\\circ\s*\}?"), " "),  # cm^2, 90^\circ
    (re.compile(r"\\[,;:! ]|\{,\}|\\left|\\right"), lambda m: "," if m.group() == "{,}" else ""),
    (re.compile(r"\\([$%])"), r"\1"),
]
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z]\w*\s*=\s*")


def normalize_number(s: str | None) -> str | None:
    """Canonical exact form (``str(Fraction)``: "1234", "-5", "3/4") of a number written
    the way answers are written, or None if ``s`` is not a single number.

    Accepted: surrounding spaces and ``$…$``; thousands groups of exactly three digits
    (``1,234``, ``1 234``, ``1{,}234``, ``1\\,234``); a decimal comma is NOT accepted
    (``3,5`` -> None); a leading sign ``-``/``+``/unicode minus before or after a leading
    currency sign (``$ € £ ¥ ₹``, also ``\\$``); leading zeros; ``5.``/``5.0``/``5.00``;
    one fraction ``a/b`` or ``\\frac{a}{b}`` (b != 0); scientific ``1e3``; a leading
    ``x =``; a trailing unit or words (``18 dollars``, ``5 cm^2``, ``90^\\circ``,
    ``18\\text{ dollars}``) and trailing punctuation. ``%`` is read as a unit label, not a
    scale: ``50%`` -> "50" (GSM8K golds write percentages as bare numbers). Rejected:
    anything with a second number, an operator or a LaTeX command left after the number
    (``5, 6``, ``2\\pi``, ``1 1/2``), words before the number."""
    if not isinstance(s, str):
        return None
    t = s.strip().replace("\u2212", "-")
    for pattern, repl in _LATEX_SUBS:
        t = pattern.sub(repl, t)
    t = t.strip()
    while len(t) >= 2 and (t[0], t[-1]) in (("$", "$"), ("{", "}")):
        t = t[1:-1].strip()
    t = _ASSIGNMENT_RE.sub("", t)
    m = _NUMBER_RE.fullmatch(t)
    if not m or (m["s1"] and m["s2"]) or not _REST_OK_RE.fullmatch(m["rest"]):
        return None

    def _frac(x: str) -> Fraction:
        return Fraction(re.sub(r"[,\s\u00a0\u2009\u202f]", "", x).rstrip("."))

    try:  # str() also raises ValueError past Python's 4300-digit int limit ("1e5000")
        value = _frac(m["num"]) / (_frac(m["den"]) if m["den"] else 1)
        return str(-value if "-" in (m["s1"] + m["s2"]) else value)
    except (ValueError, ZeroDivisionError):
        return None


# ------------------------------------------------------------------------------ accuracy
def gsm8k_accuracy(completion: str, gold: str, formats: Iterable[str] = DEFAULT_FORMATS) -> float:
    """1.0 if the completion's final answer equals the gold number as an exact rational,
    else 0.0. ``gold`` is a bare number or a full GSM8K solution ending in ``#### n``
    (the last ``####`` line is used). A missing/unparseable answer, or a gold that is not a
    number, gives 0.0. Never compares strings or first characters."""
    pred = normalize_number(extract_answer(completion, formats))
    if isinstance(gold, str) and "####" in gold:
        gold = extract_answer(gold, ("hash",))
    ref = normalize_number(gold)
    if pred is None or ref is None:
        return 0.0
    return 1.0 if Fraction(pred) == Fraction(ref) else 0.0


_MAX_MATH_ANSWER_CHARS = 1000  # longer "answers" are rambling, not parsed (0.0)


def _mv_text(answer: str) -> str:
    # An extracted answer is read as one LaTeX expression; if it carries its own math
    # delimiters ("the answer is $\frac12$") math-verify finds them itself.
    answer = answer.replace("\u2212", "-")
    if re.search(r"(?<!\\)\$|\\\(|\\\[", answer):
        return answer
    return "\\boxed{" + answer + "}"


def _mv_equal(gold: str, pred: str, timeout_s: int | None) -> bool:
    from math_verify import parse, verify  # deferred: importing sympy costs ~0.5 s
    g = parse(_mv_text(gold), parsing_timeout=timeout_s)
    p = parse(_mv_text(pred), parsing_timeout=timeout_s)
    return bool(g and p and verify(g, p, timeout_seconds=timeout_s))


def math_accuracy(completion: str, gold: str, formats: Iterable[str] = DEFAULT_FORMATS,
                  timeout_s: int = 5) -> float:
    """1.0 if math-verify judges the completion's final answer equal to the gold answer
    (LaTeX, fractions, radicals, intervals, sets, ...), else 0.0. ``gold`` is a bare answer
    or a solution containing ``\\boxed{…}``/``#### n``. Errors inside math-verify, its
    timeouts, unparseable answers and answers over 1000 characters give 0.0 (only an unknown
    format name raises).

    Threads: math-verify times out with SIGALRM, which only works in the main thread (and
    replaces any alarm the caller set). Called from the main thread, its own per-step
    timeouts of ``timeout_s`` are used; from any other thread, math-verify runs with its
    timeouts off in a daemon helper thread that is abandoned (still computing) after
    ``timeout_s`` seconds, and the reward is 0.0."""
    pred = extract_answer(completion, formats)
    ref = extract_answer(gold, DEFAULT_FORMATS) if isinstance(gold, str) else None
    ref = ref or (gold.strip() if isinstance(gold, str) else "")
    if not pred or not ref or len(pred) > _MAX_MATH_ANSWER_CHARS:
        return 0.0
    try:
        if threading.current_thread() is threading.main_thread():
            return 1.0 if _mv_equal(ref, pred, timeout_s) else 0.0
        result: list[bool] = []

        def work() -> None:
            try:
                result.append(_mv_equal(ref, pred, None))
            except BaseException:  # noqa: BLE001 - TimeoutException derives from BaseException
                result.append(False)

        helper = threading.Thread(target=work, name="math-verify", daemon=True)
        helper.start()
        helper.join(timeout_s)
        return 1.0 if result and result[0] else 0.0
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 - math_verify's TimeoutException is a BaseException
        return 0.0


# ------------------------------------------------------------------- shape and length
DEFAULT_FORMAT_PATTERN = (r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>"
                          r"\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*")
"""Whole completion = one think block, then one answer block; neither contains tags."""
THINK_OPENED_IN_PROMPT_PATTERN = DEFAULT_FORMAT_PATTERN.replace(r"\s*<think>", "", 1)
"""For chat templates (Qwen3, DeepSeek-R1) whose prompt already ends with ``<think>``."""


def format_reward(completion: str, pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    """1.0 if ``pattern`` matches the WHOLE completion (``re.fullmatch``, ``re.DOTALL``),
    else 0.0."""
    if not isinstance(completion, str):
        return 0.0
    return 1.0 if re.fullmatch(pattern, completion, re.DOTALL) else 0.0


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 while ``num_tokens <= max_tokens - buffer``,
    falling linearly to -1 at ``num_tokens == max_tokens``, -1 beyond. ``buffer == 0``
    is a hard cliff after ``max_tokens``. Raises ValueError unless
    ``0 <= buffer <= max_tokens`` and ``max_tokens > 0``."""
    if max_tokens <= 0 or not 0 <= buffer <= max_tokens:
        raise ValueError(f"need max_tokens > 0 and 0 <= buffer <= max_tokens, "
                         f"got max_tokens={max_tokens}, buffer={buffer}")
    start = max_tokens - buffer
    if num_tokens <= start:
        return 0.0
    if num_tokens > max_tokens:
        return -1.0
    return (start - num_tokens) / buffer


def truncated_flag(finish_reason: str) -> float:
    """1.0 when generation stopped on the length limit (``finish_reason == "length"``),
    else 0.0. A flag, not a penalty: give it a negative weight (``"truncated:-1"``)."""
    return 1.0 if finish_reason == "length" else 0.0


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Sample:
    """One scored rollout: the completion text, its gold answer, its length in tokens,
    the generation limit it ran under and vLLM's finish reason ("stop" / "length")."""

    completion: str
    gold: str
    num_completion_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str = "stop"


RewardFn = Callable[[Sample, Mapping[str, Any]], float]


def _params(name: str, params: Mapping[str, Any], allowed: set[str]) -> Mapping[str, Any]:
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"reward {name!r}: unknown params {sorted(unknown)}; allowed {sorted(allowed)}")
    return params


def _gsm8k(s: Sample, params: Mapping[str, Any]) -> float:
    p = _params("gsm8k", params, {"formats"})
    return gsm8k_accuracy(s.completion, s.gold, p.get("formats", DEFAULT_FORMATS))


def _math(s: Sample, params: Mapping[str, Any]) -> float:
    p = _params("math", params, {"formats", "timeout_s"})
    return math_accuracy(s.completion, s.gold, p.get("formats", DEFAULT_FORMATS),
                         int(p.get("timeout_s", 5)))


def _format(s: Sample, params: Mapping[str, Any]) -> float:
    p = _params("format", params, {"pattern"})
    return format_reward(s.completion, p.get("pattern", DEFAULT_FORMAT_PATTERN))


def _overlong(s: Sample, params: Mapping[str, Any]) -> float:
    # Default buffer is DAPO's ratio: 4096 of 20480 tokens = the last 20% of the budget.
    p = _params("overlong", params, {"buffer"})
    return overlong_penalty(s.num_completion_tokens, s.max_tokens, int(p.get("buffer", s.max_tokens // 5)))


def _truncated(s: Sample, params: Mapping[str, Any]) -> float:
    _params("truncated", params, set())
    return truncated_flag(s.finish_reason)


REWARDS: dict[str, RewardFn] = {
    "gsm8k": _gsm8k, "math": _math, "format": _format, "overlong": _overlong, "truncated": _truncated,
}

DEFAULT_REWARDS: tuple[tuple[str, float], ...] = (("gsm8k", 1.0), ("format", 0.1))
"""Accuracy dominates; the small format bonus gives signal early in training but a
well-formatted wrong answer (0.1) never outscores a correct one (>= 1.0)."""


def parse_reward_spec(spec: str) -> tuple[str, float]:
    """``"name:weight"`` (or bare ``"name"``, weight 1.0) -> ``(name, weight)``. Raises
    ValueError for an unknown name or a weight that is not a finite number; negative
    weights are allowed (``"truncated:-0.5"``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty reward spec {spec!r}; expected 'name:weight'")
    name, sep, weight_s = (x.strip() for x in spec.partition(":"))
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r} in spec {spec!r}; known: {', '.join(sorted(REWARDS))}")
    if not sep:
        return name, 1.0
    try:
        weight = float(weight_s)
    except ValueError:
        raise ValueError(f"bad weight {weight_s!r} in reward spec {spec!r}; expected a number") from None
    if not math.isfinite(weight):
        raise ValueError(f"bad weight {weight_s!r} in reward spec {spec!r}; must be finite")
    return name, weight


def combine(sample: Sample, specs: Iterable[str | tuple[str, float]] = DEFAULT_REWARDS,
            params: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[float, dict[str, float]]:
    """Score ``sample`` with every reward in ``specs`` ("name:weight" strings or
    (name, weight) pairs). ``params`` maps a reward name to its params dict. Returns
    ``(sum of weight * value, {name: unweighted value})``. Raises ValueError on a bad or
    repeated spec, or on params for a reward not in ``specs``."""
    params = params or {}
    parsed = [parse_reward_spec(s) if isinstance(s, str) else parse_reward_spec(f"{s[0]}:{s[1]}")
              for s in specs]
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"reward named twice in {names}")
    stray = set(params) - set(names)
    if stray:
        raise ValueError(f"params given for rewards not in specs: {sorted(stray)}")
    values = {n: float(REWARDS[n](sample, params.get(n, {}))) for n in names}
    return sum(w * values[n] for n, w in parsed), values
