"""Verifiers for VLM reasoning: the answer format and the math answer.

Responses are expected as ``<think>...</think><answer>...</answer>`` (R1-style).
``format`` checks that shape; ``math_answer`` compares the final answer with
``ground_truth`` using the ``math-verify`` package (LaTeX and plain expressions,
sets, intervals, numbers with rounding), run per sample; ``choice_answer`` compares
it as text (a multiple-choice letter, a word), ignoring case and surrounding space.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from mmrl.protocol import Batch
from mmrl.verifiers.base import VerifierOutput, register_verifier

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@register_verifier("format")
def format_reward(batch: Batch, pattern: str | None = None) -> VerifierOutput:
    """1.0 when ``response_text`` matches ``<think>…</think><answer>…</answer>`` (or ``pattern``),
    else 0.0.
    """
    regex = re.compile(pattern, re.DOTALL) if pattern else FORMAT_RE
    scores = np.array([float(regex.fullmatch(str(r)) is not None) for r in batch["response_text"]])
    return VerifierOutput(scores=scores, valid=np.ones(len(scores), dtype=bool))


def extract_answer(text: str) -> str:
    """The last ``<answer>…</answer>`` of ``text``; the whole text when there is none."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else text.strip()


def math_equal(answer: str, truth: str) -> bool:
    """Whether ``answer`` and ``truth`` are the same mathematical object (math-verify).

    Both sides accept LaTeX (``\\frac{1}{2}``, ``\\boxed{..}``, ``$..$``) or plain
    expressions (``1/2``, ``0.5``). math-verify's timeouts use SIGALRM, which only
    works in the main thread; elsewhere the call runs without one.
    """
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    timeout = 5 if in_main else None
    gold = parse(_as_math(truth), parsing_timeout=timeout)
    pred = parse(_as_math(answer), parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def _as_math(text: str) -> str:
    """Wrap bare text in ``$…$`` so math-verify's LaTeX extractor sees it as math."""
    text = text.strip()
    return text if "$" in text or "\\boxed" in text or "\\(" in text else f"${text}$"


@register_verifier("math_answer")
def math_answer(batch: Batch) -> VerifierOutput:
    """1.0 when the response's final answer equals ``ground_truth`` mathematically, else 0.0.

    Reports the metric ``has_answer_tag`` (fraction of responses with ``<answer>``).
    """
    responses, truths = batch["response_text"], batch["ground_truth"]
    scores = np.array(
        [
            float(math_equal(extract_answer(str(r)), str(t)))
            for r, t in zip(responses, truths, strict=True)
        ]
    )
    tagged = np.array([float(ANSWER_RE.search(str(r)) is not None) for r in responses])
    return VerifierOutput(
        scores=scores, valid=np.ones(len(scores), dtype=bool), metrics={"has_answer_tag": tagged}
    )


@register_verifier("choice_answer")
def choice_answer(batch: Batch) -> VerifierOutput:
    """1.0 when the response's final answer is ``ground_truth`` as text (case and outer space
    ignored).

    For answers that are words or option letters, where ``math_answer`` would read
    ``der`` as the product d*e*r and call it equal to ``red``.
    """
    responses, truths = batch["response_text"], batch["ground_truth"]
    scores = np.array(
        [
            float(extract_answer(str(r)).casefold() == str(t).strip().casefold())
            for r, t in zip(responses, truths, strict=True)
        ]
    )
    tagged = np.array([float(ANSWER_RE.search(str(r)) is not None) for r in responses])
    return VerifierOutput(
        scores=scores, valid=np.ones(len(scores), dtype=bool), metrics={"has_answer_tag": tagged}
    )
