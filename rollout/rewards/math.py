"""Math answers: the last \\boxed{...} of a reply, graded against the reference with
math-verify (equivalent forms count: 1/2, 0.5 and \\frac{1}{2} are one answer).

math-verify's own timeouts use signal.alarm, which only works in the main thread, so they
are turned off here and the deadline is enforced around the call instead: grading runs in
a worker thread that the caller stops waiting for at the deadline (score 0).
"""

from __future__ import annotations

import asyncio
import logging

from math_verify import parse, verify

BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} in text, braces balanced; None if absent."""
    start = text.rfind(BOXED)
    if start == -1:
        return None
    depth, index = 1, start + len(BOXED)
    while index < len(text):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(BOXED) : index]
        index += 1
    return None


def answers_match(answer: str, reference: str) -> bool:
    """Whether `answer` equals `reference` mathematically (no deadline: see grade_answer)."""
    # Its "timeout is disabled" warning is expected here: grade_answer enforces one.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(f"${reference}$", parsing_timeout=None)
    given = parse(f"${answer}$", parsing_timeout=None)
    if not gold or not given:
        return answer.strip() == reference.strip()
    return bool(verify(gold, given, timeout_seconds=None))


async def grade_answer(answer: str | None, reference: str, deadline_s: float = 10.0) -> float:
    """1.0 if the answer matches the reference, else 0.0 (also when grading overruns)."""
    if answer is None:
        return 0.0
    try:
        matched = await asyncio.wait_for(
            asyncio.to_thread(answers_match, answer, reference), deadline_s
        )
    except TimeoutError:
        return 0.0
    return 1.0 if matched else 0.0
