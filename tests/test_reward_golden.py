"""Golden tests of the built-in rewards (components/reward/rewards.py).

Every row of GOLDEN was decided by hand: (id, reward name, completion, gold, expected value,
extra). ``extra`` holds the Sample's other fields (tokens/max_tokens/finish) and the
reward's params. Rows marked ``xfail`` are cases where math-verify decides differently
from the mathematically right answer; they are strict, so an upstream fix shows up.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from components.reward import rewards as R
from components.reward.rewards import (
    DEFAULT_REWARDS, REWARDS, THINK_OPENED_IN_PROMPT_PATTERN, Sample, combine,
    extract_answer, math_accuracy, normalize_number, parse_reward_spec,
)

XFAIL = "xfail"
ALL_FORMATS = ["answer_tag", "hash", "boxed", "last_number"]
GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")
GSM8K_GOLD_COMMA = "Each box holds 12 * 100 = <<12*100=1200>>1,200 pens.\n#### 1,200"
MATH_GOLD = r"We have $x^2 = 4$ with $x > 0$, so $x = \boxed{2}$."
MATH_GOLD_FRAC = r"Of the 36 outcomes 6 are doubles, so the probability is $\boxed{\frac{1}{6}}$."
OK_FMT = "<think>6 * 12 = 72</think>\n<answer>72</answer>"

GOLDEN: list[tuple] = [
    # ------------------------------------------------------------------ gsm8k: formats
    ("g_hash", "gsm8k", "She has 6 * 12 = 72 apples.\n#### 72", "72", 1.0, {}),
    ("g_hash_wrong", "gsm8k", "#### 71", "72", 0.0, {}),
    ("g_answer_tag", "gsm8k", OK_FMT, "72", 1.0, {}),
    ("g_boxed", "gsm8k", r"The total is $\boxed{72}$.", "72", 1.0, {}),
    ("g_boxed_inside_tag", "gsm8k", r"<answer>\boxed{16}</answer>", "16", 1.0, {}),
    ("g_boxed_inside_hash", "gsm8k", r"#### \boxed{16}", "16", 1.0, {}),
    ("g_boxed_double_braces", "gsm8k", r"\boxed{{18}}", "18", 1.0, {}),
    ("g_boxed_nested_text", "gsm8k", r"\boxed{\text{\$}18}", "18", 1.0, {}),
    ("g_markdown_heading_not_hash", "gsm8k",
     "#### Step 1: add\n7 + 5 = 12\n#### Final Answer\n" r"\boxed{72}", "72", 1.0, {}),
    # ------------------------------------------------------------ gsm8k: several answers
    ("g_two_hash_take_last", "gsm8k", "#### 10\nWait, I made a mistake.\n#### 12", "12", 1.0, {}),
    ("g_two_hash_first_is_gold", "gsm8k", "#### 12\nHmm, actually\n#### 10", "12", 0.0, {}),
    ("g_two_boxed_take_last", "gsm8k", r"\boxed{3} ... no, it is \boxed{4}", "4", 1.0, {}),
    ("g_two_boxed_first_is_gold", "gsm8k", r"\boxed{3} ... no, it is \boxed{4}", "3", 0.0, {}),
    ("g_two_tags_take_last", "gsm8k", "<answer>3</answer> redo <answer>4</answer>", "4", 1.0, {}),
    ("g_tag_beats_boxed", "gsm8k", r"<answer>5</answer> so \boxed{7}", "5", 1.0, {}),
    ("g_tag_beats_boxed_miss", "gsm8k", r"<answer>5</answer> so \boxed{7}", "7", 0.0, {}),
    ("g_hash_beats_boxed", "gsm8k", "\\boxed{9}\n#### 8", "8", 1.0, {}),
    ("g_hash_beats_boxed_miss", "gsm8k", "\\boxed{9}\n#### 8", "9", 0.0, {}),
    ("g_formats_boxed_only", "gsm8k", r"<answer>5</answer> so \boxed{7}", "7", 1.0,
     {"params": {"formats": ["boxed"]}}),
    ("g_two_numbers_in_answer", "gsm8k", "<answer>72 or 73</answer>", "72", 0.0, {}),
    ("g_words_before_number", "gsm8k", "<answer>The answer is 72</answer>", "72", 0.0, {}),
    ("g_assignment", "gsm8k", "<answer>x = 5</answer>", "5", 1.0, {}),
    # ------------------------------------------------------ gsm8k: missing / truncated
    ("g_no_answer", "gsm8k", "She has 72 apples.", "72", 0.0, {}),
    ("g_no_answer_last_number_on", "gsm8k", "She has 72 apples.", "72", 1.0,
     {"params": {"formats": ALL_FORMATS}}),
    ("g_last_number_takes_last", "gsm8k", "First 10, then 20, so 30 in all.", "30", 1.0,
     {"params": {"formats": ALL_FORMATS}}),
    ("g_last_number_comma", "gsm8k", "That costs $1,250 total", "1250", 1.0,
     {"params": {"formats": ALL_FORMATS}}),
    ("g_empty_completion", "gsm8k", "", "72", 0.0, {}),
    ("g_whitespace_completion", "gsm8k", "  \n ", "0", 0.0, {}),
    ("g_boxed_empty", "gsm8k", r"\boxed{}", "0", 0.0, {}),
    ("g_boxed_empty_is_last", "gsm8k", r"\boxed{5} hmm \boxed{}", "5", 0.0, {}),
    ("g_answer_tag_empty", "gsm8k", "<answer>  </answer>", "0", 0.0, {}),
    ("g_hash_empty", "gsm8k", "####\n5", "5", 0.0, {}),
    ("g_truncated_boxed", "gsm8k", r"The answer is \boxed{7", "7", 0.0, {"finish": "length"}),
    ("g_truncated_tag", "gsm8k", "<think>3+4=7</think><answer>7", "7", 0.0, {"finish": "length"}),
    ("g_truncated_tag_earlier_boxed", "gsm8k", r"so \boxed{7}. <answer>7", "7", 1.0, {}),
    # ---------------------------------------------------------------- gsm8k: numbers
    ("g_comma_pred", "gsm8k", "#### 1,234", "1234", 1.0, {}),
    ("g_comma_gold", "gsm8k", "#### 1234", "1,234", 1.0, {}),
    ("g_comma_million", "gsm8k", "<answer>1,000,000</answer>", "1000000", 1.0, {}),
    ("g_comma_decimal", "gsm8k", "#### 1,234.50", "1234.5", 1.0, {}),
    ("g_latex_comma", "gsm8k", r"\boxed{1{,}234}", "1234", 1.0, {}),
    ("g_latex_thin_space", "gsm8k", r"\boxed{1\,234}", "1234", 1.0, {}),
    ("g_space_groups", "gsm8k", "<answer>1 000 000</answer>", "1000000", 1.0, {}),
    ("g_bad_grouping", "gsm8k", "#### 1,23", "123", 0.0, {}),
    ("g_decimal_comma_rejected", "gsm8k", "#### 3,5", "3.5", 0.0, {}),
    ("g_negative", "gsm8k", "#### -5", "-5", 1.0, {}),
    ("g_negative_vs_positive", "gsm8k", "#### 5", "-5", 0.0, {}),
    ("g_positive_vs_negative", "gsm8k", "#### -5", "5", 0.0, {}),
    ("g_unicode_minus", "gsm8k", "#### \u22125", "-5", 1.0, {}),
    ("g_unicode_minus_gold", "gsm8k", "#### -12", "\u221212", 1.0, {}),
    ("g_unicode_minus_boxed", "gsm8k", "\\boxed{\u22123}", "-3", 1.0, {}),
    ("g_plus_sign", "gsm8k", "#### +5", "5", 1.0, {}),
    ("g_minus_zero", "gsm8k", "#### -0", "0", 1.0, {}),
    ("g_double_sign", "gsm8k", "#### +-5", "-5", 0.0, {}),
    ("g_dollar", "gsm8k", "#### $18", "18", 1.0, {}),
    ("g_dollar_latex", "gsm8k", r"\boxed{\$18}", "18", 1.0, {}),
    ("g_dollar_math_delims", "gsm8k", "<answer>$18$</answer>", "18", 1.0, {}),
    ("g_euro", "gsm8k", "<answer>€45</answer>", "45", 1.0, {}),
    ("g_pound_decimal", "gsm8k", "<answer>£2.50</answer>", "2.5", 1.0, {}),
    ("g_minus_dollar", "gsm8k", "<answer>-$5</answer>", "-5", 1.0, {}),
    ("g_dollar_minus", "gsm8k", "<answer>$-5</answer>", "-5", 1.0, {}),
    ("g_trailing_dollars", "gsm8k", "#### 18 dollars", "18", 1.0, {}),
    ("g_trailing_words_wrong", "gsm8k", "#### 17 dollars", "18", 0.0, {}),
    ("g_unit_cm", "gsm8k", "<answer>5 cm</answer>", "5", 1.0, {}),
    ("g_unit_cm2", "gsm8k", "<answer>25 cm^2</answer>", "25", 1.0, {}),
    ("g_unit_text_latex", "gsm8k", r"\boxed{18\text{ dollars}}", "18", 1.0, {}),
    ("g_degrees", "gsm8k", r"\boxed{90^\circ}", "90", 1.0, {}),
    ("g_percent", "gsm8k", "#### 25%", "25", 1.0, {}),
    ("g_percent_latex", "gsm8k", r"\boxed{25\%}", "25", 1.0, {}),
    ("g_percent_is_not_scaled", "gsm8k", "#### 0.25", "25", 0.0, {}),
    ("g_decimal_zero", "gsm8k", "#### 5.0", "5", 1.0, {}),
    ("g_decimal_two_zeros", "gsm8k", r"\boxed{72.00}", "72", 1.0, {}),
    ("g_decimal_half", "gsm8k", "#### 5.5", "5", 0.0, {}),
    ("g_decimal_gold_trailing_zero", "gsm8k", "#### 5.5", "5.50", 1.0, {}),
    ("g_decimal_exact_not_float", "gsm8k", "#### 0.3", "0.30", 1.0, {}),
    ("g_huge_ints_exact", "gsm8k", "#### 12345678901234567890", "12345678901234567891", 0.0, {}),
    ("g_trailing_period", "gsm8k", "<answer>72.</answer>", "72", 1.0, {}),
    ("g_leading_zeros", "gsm8k", "#### 007", "7", 1.0, {}),
    ("g_spaces", "gsm8k", "<answer>   42   </answer>", "42", 1.0, {}),
    ("g_fraction", "gsm8k", "#### 3/4", "0.75", 1.0, {}),
    ("g_fraction_unreduced", "gsm8k", "<answer>6/8</answer>", "3/4", 1.0, {}),
    ("g_fraction_latex", "gsm8k", r"\boxed{\frac{3}{4}}", "0.75", 1.0, {}),
    ("g_fraction_dfrac_negative", "gsm8k", r"\boxed{-\dfrac{3}{2}}", "-1.5", 1.0, {}),
    ("g_fraction_vs_rounded", "gsm8k", "#### 3/4", "0.7", 0.0, {}),
    ("g_fraction_third_vs_decimal", "gsm8k", "#### 0.33", "1/3", 0.0, {}),
    ("g_division_by_zero", "gsm8k", "#### 1/0", "0", 0.0, {}),
    ("g_mixed_number_rejected", "gsm8k", "#### 1 1/2", "1.5", 0.0, {}),
    ("g_pi_not_a_number", "gsm8k", r"\boxed{2\pi}", "2", 0.0, {}),
    ("g_power_not_evaluated", "gsm8k", r"\boxed{2^3}", "8", 0.0, {}),
    ("g_gold_not_a_number", "gsm8k", "<answer>5</answer>", "five", 0.0, {}),
    # QeRL's released evaluator compared first characters; its reward compared strings.
    ("g_first_char_guard_short", "gsm8k", "#### 7", "72", 0.0, {}),
    ("g_first_char_guard_long", "gsm8k", "#### 721", "72", 0.0, {}),
    ("g_first_char_guard_same_digit", "gsm8k", "#### 70", "72", 0.0, {}),
    ("g_string_guard", "gsm8k", "<answer>72.0</answer>", "72", 1.0, {}),
    # ------------------------------------------------------- gsm8k: full-solution golds
    ("g_gold_full_solution", "gsm8k", "#### 72", GSM8K_GOLD, 1.0, {}),
    ("g_gold_full_solution_intermediate", "gsm8k", "#### 24", GSM8K_GOLD, 0.0, {}),
    ("g_gold_full_solution_first_number", "gsm8k", "#### 48", GSM8K_GOLD, 0.0, {}),
    ("g_gold_full_solution_comma", "gsm8k", "<answer>1200</answer>", GSM8K_GOLD_COMMA, 1.0, {}),
    # ------------------------------------------------------------------------ math
    ("m_frac_vs_decimal", "math", r"\boxed{0.5}", r"\frac{1}{2}", 1.0, {}),
    ("m_decimal_gold", "math", r"\boxed{\frac{1}{2}}", "0.5", 1.0, {}),
    ("m_dfrac_short", "math", r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0, {}),
    ("m_slash_frac", "math", "<answer>1/2</answer>", r"\frac{1}{2}", 1.0, {}),
    ("m_frac_wrong", "math", r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0, {}),
    ("m_third_rounded_3", "math", r"\boxed{0.333}", r"\frac{1}{3}", 0.0, {}),
    ("m_third_rounded_6", "math", r"\boxed{0.333333}", r"\frac{1}{3}", 1.0, {}),
    ("m_nested_braces", "math", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0, {}),
    ("m_sqrt", "math", r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0, {}),
    ("m_sqrt_rationalized", "math", r"\boxed{\frac{2}{\sqrt{2}}}", r"\sqrt{2}", 1.0, {}),
    ("m_sqrt_simplified", "math", r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0, {}),
    ("m_sqrt_vs_3_decimals", "math", r"\boxed{1.414}", r"\sqrt{2}", 0.0, {}),
    ("m_sqrt_wrong", "math", r"\boxed{\sqrt{3}}", r"\sqrt{2}", 0.0, {}),
    ("m_pi_vs_decimal", "math", r"\boxed{3.14}", r"\pi", 0.0, {}),
    ("m_interval_same", "math", r"\boxed{[0,1)}", "[0,1)", 1.0, {}),
    ("m_interval_closed_vs_halfopen", "math", r"\boxed{[0,1]}", "[0,1)", 0.0, {}),
    ("m_interval_open_vs_halfopen", "math", r"\boxed{(0,1)}", "[0,1)", 0.0, {}),
    ("m_interval_infinite", "math", r"\boxed{(-\infty,3]}", r"(-\infty, 3]", 1.0, {}),
    ("m_set_order", "math", r"\boxed{\{2,1\}}", r"\{1,2\}", 1.0, {}),
    ("m_set_missing", "math", r"\boxed{\{1\}}", r"\{1,2\}", 0.0, {}),
    ("m_set_extra", "math", r"\boxed{\{1,2,3\}}", r"\{1,2\}", 0.0, {}),
    ("m_set_as_list", "math", r"\boxed{1, 2}", r"\{1,2\}", 1.0, {}),
    # math-verify compares an open interval (a,b) with a 2-element set as the pair (a,b).
    ("m_set_vs_open_interval", "math", r"\boxed{(1,2)}", r"\{1,2\}", 0.0, {XFAIL: True}),
    ("m_polynomial_equiv", "math", r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0, {}),
    ("m_polynomial_wrong", "math", r"\boxed{(x-1)^2}", "x^2+2x+1", 0.0, {}),
    ("m_assignment", "math", r"\boxed{x=5}", "5", 1.0, {}),
    ("m_power_evaluated", "math", r"\boxed{2^{10}}", "1024", 1.0, {}),
    ("m_power_gsm_contrast", "math", r"\boxed{2^3}", "8", 1.0, {}),
    ("m_negative_frac", "math", r"\boxed{-\frac{3}{4}}", "-0.75", 1.0, {}),
    ("m_sign_wrong", "math", r"\boxed{\frac{3}{4}}", r"-\frac{3}{4}", 0.0, {}),
    ("m_unicode_minus", "math", "\\boxed{\u22125}", "-5", 1.0, {}),
    ("m_thousands", "math", r"\boxed{1,000}", "1000", 1.0, {}),
    ("m_percent", "math", r"\boxed{50\%}", "50", 1.0, {}),
    ("m_degrees", "math", r"\boxed{90^\circ}", "90", 1.0, {}),
    ("m_text_choice", "math", r"\boxed{B}", r"\text{(B)}", 1.0, {}),
    ("m_text_choice_wrong", "math", r"\boxed{C}", r"\text{(B)}", 0.0, {}),
    ("m_prose_in_box", "math", r"\boxed{The answer is 5}", "5", 0.0, {}),
    ("m_tag_with_dollars", "math", r"<answer>The answer is $\frac{1}{2}$</answer>", "0.5", 1.0, {}),
    ("m_hash_latex", "math", "#### \\frac{1}{2}", "0.5", 1.0, {}),
    ("m_two_boxed_take_last", "math", r"\boxed{\frac12} wait, \boxed{\frac13}", r"\frac13", 1.0, {}),
    ("m_two_boxed_first_is_gold", "math", r"\boxed{\frac12} wait, \boxed{\frac13}", r"\frac12", 0.0, {}),
    ("m_gold_full_solution", "math", "<answer>2</answer>", MATH_GOLD, 1.0, {}),
    ("m_gold_full_solution_wrong", "math", "<answer>4</answer>", MATH_GOLD, 0.0, {}),
    ("m_gold_solution_nested", "math", r"\boxed{\frac{1}{6}}", MATH_GOLD_FRAC, 1.0, {}),
    ("m_gold_solution_nested_wrong", "math", r"\boxed{\frac{1}{5}}", MATH_GOLD_FRAC, 0.0, {}),
    ("m_gold_gsm8k_style", "math", r"\boxed{1200}", GSM8K_GOLD_COMMA, 1.0, {}),
    ("m_no_answer", "math", "so the answer is 1/2", r"\frac12", 0.0, {}),
    ("m_empty_completion", "math", "", r"\frac12", 0.0, {}),
    ("m_boxed_empty", "math", r"\boxed{}", "0", 0.0, {}),
    ("m_truncated", "math", r"\boxed{\frac{1}{2}", r"\frac12", 0.0, {"finish": "length"}),
    ("m_empty_gold", "math", r"\boxed{1}", "", 0.0, {}),
    # ---------------------------------------------------------------------- format
    ("f_basic", "format", OK_FMT, "", 1.0, {}),
    ("f_whitespace_around", "format", "\n<think>\nstep\n</think>\n\n<answer>\n42\n</answer>\n", "", 1.0, {}),
    ("f_empty_blocks", "format", "<think></think><answer></answer>", "", 1.0, {}),
    ("f_missing_think", "format", "<answer>42</answer>", "", 0.0, {}),
    ("f_missing_answer", "format", "<think>hmm</think> 42", "", 0.0, {}),
    ("f_text_after", "format", OK_FMT + " Hope this helps!", "", 0.0, {}),
    ("f_text_before", "format", "Sure! " + OK_FMT, "", 0.0, {}),
    ("f_reversed", "format", "<answer>42</answer><think>x</think>", "", 0.0, {}),
    ("f_two_answers", "format", "<think>a</think><answer>1</answer><answer>2</answer>", "", 0.0, {}),
    ("f_nested_think", "format", "<think>a<think>b</think></think><answer>1</answer>", "", 0.0, {}),
    ("f_truncated", "format", "<think>a</think><answer>4", "", 0.0, {"finish": "length"}),
    ("f_empty", "format", "", "", 0.0, {}),
    ("f_uppercase_tags", "format", "<THINK>a</THINK><ANSWER>1</ANSWER>", "", 0.0, {}),
    ("f_think_opened_in_prompt_default", "format", "a</think><answer>1</answer>", "", 0.0, {}),
    ("f_think_opened_in_prompt", "format", "a</think>\n<answer>1</answer>", "", 1.0,
     {"params": {"pattern": THINK_OPENED_IN_PROMPT_PATTERN}}),
    ("f_custom_hit", "format", "Thus \\boxed{5}.", "", 1.0, {"params": {"pattern": r".*\\boxed\{.+\}.*"}}),
    ("f_custom_miss", "format", "Thus 5.", "", 0.0, {"params": {"pattern": r".*\\boxed\{.+\}.*"}}),
    # -------------------------------------------------------- overlong (max 1000, buffer 200)
    ("o_zero_tokens", "overlong", "", "", 0.0, {"tokens": 0, "max": 1000, "params": {"buffer": 200}}),
    ("o_at_threshold", "overlong", "", "", 0.0, {"tokens": 800, "max": 1000, "params": {"buffer": 200}}),
    ("o_one_past_threshold", "overlong", "", "", -0.005, {"tokens": 801, "max": 1000, "params": {"buffer": 200}}),
    ("o_half", "overlong", "", "", -0.5, {"tokens": 900, "max": 1000, "params": {"buffer": 200}}),
    ("o_three_quarters", "overlong", "", "", -0.75, {"tokens": 950, "max": 1000, "params": {"buffer": 200}}),
    ("o_at_max", "overlong", "", "", -1.0, {"tokens": 1000, "max": 1000, "params": {"buffer": 200}}),
    ("o_past_max", "overlong", "", "", -1.0, {"tokens": 1001, "max": 1000, "params": {"buffer": 200}}),
    ("o_far_past_max", "overlong", "", "", -1.0, {"tokens": 5000, "max": 1000, "params": {"buffer": 200}}),
    ("o_no_buffer_at_max", "overlong", "", "", 0.0, {"tokens": 1000, "max": 1000, "params": {"buffer": 0}}),
    ("o_no_buffer_past_max", "overlong", "", "", -1.0, {"tokens": 1001, "max": 1000, "params": {"buffer": 0}}),
    ("o_default_buffer_is_20pct", "overlong", "", "", -0.5, {"tokens": 900, "max": 1000}),
    ("o_buffer_is_all_start", "overlong", "", "", 0.0, {"tokens": 0, "max": 100, "params": {"buffer": 100}}),
    ("o_buffer_is_all_mid", "overlong", "", "", -0.5, {"tokens": 50, "max": 100, "params": {"buffer": 100}}),
    ("o_dapo_config", "overlong", "", "", -0.25, {"tokens": 17408, "max": 20480, "params": {"buffer": 4096}}),
    # ---------------------------------------------------------------------- truncated
    ("t_length", "truncated", "", "", 1.0, {"finish": "length"}),
    ("t_stop", "truncated", "", "", 0.0, {"finish": "stop"}),
    ("t_abort", "truncated", "", "", 0.0, {"finish": "abort"}),
    ("t_empty", "truncated", "", "", 0.0, {"finish": ""}),
    ("t_case_sensitive", "truncated", "", "", 0.0, {"finish": "LENGTH"}),
]


def _param(row):
    marks = [pytest.mark.xfail(strict=True, reason="math-verify leniency")] if row[5].get(XFAIL) else []
    return pytest.param(*row, id=row[0], marks=marks)


def test_golden_table_is_well_formed():
    ids = [r[0] for r in GOLDEN]
    assert len(ids) == len(set(ids)), "duplicate ids"
    assert len(GOLDEN) >= 100
    assert {r[1] for r in GOLDEN} == set(REWARDS)


@pytest.mark.parametrize("case_id,name,completion,gold,expected,extra", [_param(r) for r in GOLDEN])
def test_golden(case_id, name, completion, gold, expected, extra):
    sample = Sample(completion=completion, gold=gold, num_completion_tokens=extra.get("tokens", 0),
                    max_tokens=extra.get("max", 4096), finish_reason=extra.get("finish", "stop"))
    assert REWARDS[name](sample, extra.get("params", {})) == pytest.approx(expected, abs=1e-12)


# ------------------------------------------------------------ extraction / normalization
@pytest.mark.parametrize("text,expected", [
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),
    (r"\boxed{a} and \fbox{b}", "b"),
    (r"\boxed{\boxed{5}}", "5"),
    ("<answer>\n 7 \n</answer>", "7"),
    ("#### 72 apples\nthanks", "72 apples"),
    ("####-5", "-5"),
    ("#### Final Answer", None),
    ("<answer>#### 9</answer>", "9"),
    ("<ANSWER>9</ANSWER>", None),
    ("<answer>a <answer>5</answer>", "5"),
    (r"} \boxed{4} }", "4"),
    (r"\boxed{ \boxed{1} ", "1"),
    (None, None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extraction_is_linear_on_degenerate_outputs():
    t0 = time.monotonic()
    assert extract_answer("\\boxed{" * 50_000) is None
    assert extract_answer("\\boxed{1}" * 50_000 + "<answer>" * 20_000) == "1"
    assert R.format_reward("<think>" + "a" * 200_000 + "</think><answer>1</answer>") == 1.0
    assert time.monotonic() - t0 < 2.0


def test_math_accuracy_skips_overlong_answers():
    assert math_accuracy(r"\boxed{" + "1+" * 300 + "1}", "301") == 1.0
    assert math_accuracy(r"\boxed{" + "1+" * 600 + "1}", "601") == 0.0  # > 1000 chars: not parsed


def test_extract_answer_unknown_format():
    with pytest.raises(ValueError, match="unknown answer format"):
        extract_answer("<answer>1</answer>", formats=("answer_tag", "latex"))
    assert extract_answer(r"<answer>1</answer> \boxed{2}", formats="boxed") == "2"
    with pytest.raises(ValueError, match="unknown answer format"):
        REWARDS["math"](Sample(r"\boxed{1}", "1"), {"formats": ["boxd"]})


@pytest.mark.parametrize("text,expected", [
    ("1,234", "1234"), ("-$5", "-5"), ("\u22125", "-5"), ("+5", "5"), ("007", "7"), (" 42 ", "42"),
    ("5.00", "5"), ("5.", "5"), (".5", "1/2"), ("6/8", "3/4"), (r"\frac{3}{4}", "3/4"), ("50%", "50"),
    ("1e3", "1000"), ("18 dollars.", "18"), ("1,234.50", "2469/2"), ("3,5", None), ("5, 6", None),
    ("2^3", None), (r"2\pi", None), ("1/0", None), ("abc", None), ("", None), (None, None),
    ("1e5000", None), ("9" * 5000, None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


# ------------------------------------------------------------------- spec and combine
@pytest.mark.parametrize("spec,expected", [
    ("gsm8k:1.0", ("gsm8k", 1.0)), (" format : 0.1 ", ("format", 0.1)),
    ("truncated:-0.5", ("truncated", -0.5)), ("math", ("math", 1.0)), ("overlong:2", ("overlong", 2.0)),
])
def test_parse_reward_spec(spec, expected):
    assert parse_reward_spec(spec) == expected


@pytest.mark.parametrize("spec,match", [
    ("gsm8:1.0", "unknown reward 'gsm8'"), ("GSM8K:1", "unknown reward"), (":1", "unknown reward"),
    ("gsm8k:abc", "bad weight 'abc'"), ("gsm8k:", "bad weight ''"), ("gsm8k:1:2", "bad weight '1:2'"),
    ("gsm8k:nan", "must be finite"), ("gsm8k:inf", "must be finite"), ("", "empty reward spec"),
])
def test_parse_reward_spec_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_reward_spec(spec)


def test_default_rewards():
    assert DEFAULT_REWARDS == (("gsm8k", 1.0), ("format", 0.1))
    assert combine(Sample(OK_FMT, "72")) == (pytest.approx(1.1), {"gsm8k": 1.0, "format": 1.0})
    assert combine(Sample(OK_FMT, "73")) == (pytest.approx(0.1), {"gsm8k": 0.0, "format": 1.0})
    assert combine(Sample("#### 72", "72")) == (1.0, {"gsm8k": 1.0, "format": 0.0})


def test_combine_specs_and_params():
    s = Sample("<think>long</think><answer>72</answer> trailing", GSM8K_GOLD,
               num_completion_tokens=900, max_tokens=1000, finish_reason="length")
    total, values = combine(s, ["gsm8k:1", ("format", 0.5), "overlong:1", "truncated:-0.25"],
                            params={"overlong": {"buffer": 200}})
    assert values == {"gsm8k": 1.0, "format": 0.0, "overlong": -0.5, "truncated": 1.0}
    assert total == pytest.approx(1.0 * 1.0 + 0.5 * 0.0 + 1.0 * -0.5 + -0.25 * 1.0)


@pytest.mark.parametrize("specs,params,match", [
    (["gsm8k:1", "gsm8k:2"], None, "named twice"),
    (["gsm8k:1"], {"format": {}}, "not in specs"),
    (["gsm8k:1"], {"gsm8k": {"fromats": ["boxed"]}}, "unknown params"),
    (["nope:1"], None, "unknown reward"),
    (["overlong:1"], {"overlong": {"buffer": 5000}}, "buffer <= max_tokens"),
])
def test_combine_errors(specs, params, match):
    with pytest.raises(ValueError, match=match):
        combine(Sample("x", "1", max_tokens=1000), specs, params)


# ------------------------------------------------------- math-verify: threads, failures
def test_math_accuracy_in_worker_threads():
    jobs = [(r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{[0,1]}", "[0,1)", 0.0),
            (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0), ("", "1", 0.0)] * 3
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda j: math_accuracy(j[0], j[1]), jobs))
    assert got == [j[2] for j in jobs]


def test_math_accuracy_worker_thread_deadline(monkeypatch):
    monkeypatch.setattr(R, "_mv_equal", lambda g, p, t: time.sleep(3) or True)
    out = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: out.append(math_accuracy(r"\boxed{1}", "1", timeout_s=1)))
    worker.start()
    worker.join()
    assert out == [0.0] and time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("exc", [RuntimeError("boom"), RecursionError(), ValueError("x")])
def test_math_accuracy_swallows_errors(monkeypatch, exc):
    def boom(*_):
        raise exc
    monkeypatch.setattr(R, "_mv_equal", boom)
    assert math_accuracy(r"\boxed{1}", "1") == 0.0


def test_math_accuracy_swallows_math_verify_timeout(monkeypatch):
    from math_verify.errors import TimeoutException  # a BaseException, not an Exception

    def slow(*_):
        raise TimeoutException("Operation timed out!")
    monkeypatch.setattr(R, "_mv_equal", slow)
    assert math_accuracy(r"\boxed{1}", "1") == 0.0


def test_rewards_module_does_not_import_torch_or_sympy():
    code = ("import sys, components.reward.rewards; "
            "assert 'torch' not in sys.modules and 'sympy' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
