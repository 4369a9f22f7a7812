"""A chat's resent answers encode back to the ids they were drawn as (``answer_ids``), so
each turn's prompt ids begin with the ids the turn before held."""

from __future__ import annotations

from p2pswarm.agent.serving.answer_ids import ANSWERS_KEPT, AnswerIds
from p2pswarm.models.chat_template import plain_prompt
from p2pswarm.models.tokenizer import ByteTokenizer

PLAN = "3f9a1c0d2e4b5a6f"


def test_a_resent_answer_keeps_its_own_ids() -> None:
    tok = ByteTokenizer()
    answers = AnswerIds()
    # bytes that are no UTF-8: their text ("\ufffd...") encodes to other bytes
    drawn = [200, 65, 66, 201, 67, 202]
    text = tok.decode(drawn)
    assert tok.encode(text, add_bos=False) != drawn
    messages = [{"role": "user", "content": "Hello there"}]
    first = answers.encode(PLAN, tok, plain_prompt(messages))
    assert first == tok.encode(plain_prompt(messages))  # nothing noted yet: plain encoding
    answers.note(PLAN, tok, text, drawn)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More"}]
    second = answers.encode(PLAN, tok, plain_prompt(messages))
    assert second[:len(first) + len(drawn)] == first + drawn
    assert tok.decode(second) == plain_prompt(messages)
    assert second.count(tok.bos_id) == 1
    # another load's answers are its own
    assert answers.encode("other", tok, plain_prompt(messages)) == tok.encode(
        plain_prompt(messages))


def test_only_answers_that_decode_to_their_text_are_noted_and_they_are_bounded() -> None:
    tok = ByteTokenizer()
    answers = AnswerIds()
    answers.note(PLAN, tok, "not these bytes", [200, 201, 202, 203])
    answers.note(PLAN, tok, "ab", [97, 98])  # too short to be told from any text
    assert answers.encode(PLAN, tok, "say not these bytes") == tok.encode(
        "say not these bytes")
    for i in range(ANSWERS_KEPT + 1):
        answers.note(PLAN, tok, f"answer {i:03d}", tok.encode(f"answer {i:03d}", add_bos=False))
    assert len(answers._answers[PLAN]) == ANSWERS_KEPT
    assert "answer 000" not in answers._answers[PLAN]
