"""The router's answer splice with the tiny model's real tokenizer: a client sends its whole
conversation back, and each answer goes in as the tokens the model generated for it, but only
as the answer to the prompt it answered. Otherwise a conversation whose earlier answers this
stack holds as re-tokenized text (it moved here from another stack), or two answers with one
text, would no longer extend what the worker holds, and lose its cache."""

from __future__ import annotations

import pytest

from kvbank.router.tokenizer import AnswerTokens, PromptTokenizer, message_key

pytestmark = pytest.mark.unit  # make test-fast

TENANT = ""
SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def tok(tiny_model) -> PromptTokenizer:
    return PromptTokenizer(tiny_model)


def _spellings(tok: PromptTokenizer, text: str) -> list[list[int]]:
    """`text` as its own tokens, and as two other token sequences that decode to it."""
    canonical = tok.encode(text)
    others = [tok.encode(text[:k]) + tok.encode(text[k:]) for k in (2, 4)]
    assert all(tok.decode(o) == text for o in others)
    assert len({tuple(canonical), *map(tuple, others)}) == 3, "pick a text that splits"
    return [canonical, *others]


def _prompt(tok: PromptTokenizer, answers: AnswerTokens, messages: list[dict]) -> list[int]:
    return tok.chat(messages, answer_tokens=lambda key, prompt: answers.get(TENANT, key, prompt))


def test_a_conversation_that_moved_here_keeps_extending_what_this_stack_holds(tok):
    """Turn 0 was answered elsewhere ("Done reading", tokens unknown here), so turn 1's prompt
    has that answer as text; turn 1 is answered here with the same text in other tokens.
    Turn 2's prompt is turn 1's prompt and turn 1's generated tokens, then what is new."""
    text = " Done reading"
    _, generated, _ = _spellings(tok, text)
    answers = AnswerTokens()
    turn1 = [SYSTEM, {"role": "user", "content": "Read main.py."},
             {"role": "assistant", "content": text},
             {"role": "user", "content": "Now read util.py."}]
    prompt1 = _prompt(tok, answers, turn1)
    assert prompt1 == tok.chat(turn1)  # nothing known here: the template, tokenized
    answers.put(TENANT, prompt1, message_key({"role": "assistant", "content": text}), generated)

    turn2 = turn1 + [{"role": "assistant", "content": text},
                     {"role": "user", "content": "Now fix the bug."}]
    prompt2 = _prompt(tok, answers, turn2)
    assert prompt2[:len(prompt1) + len(generated)] == prompt1 + generated


def test_two_answers_with_one_text_each_go_back_as_their_own_tokens(tok):
    text = " Done reading"
    _, first, second = _spellings(tok, text)
    key = message_key({"role": "assistant", "content": text})
    answers = AnswerTokens()
    messages = [SYSTEM, {"role": "user", "content": "Read main.py."}]
    held: list[int] = []  # what the worker holds: each prompt and its answer
    for ids, follow_up in ((first, "Now read util.py."), (second, "Now fix the bug.")):
        prompt = _prompt(tok, answers, messages)
        assert prompt[:len(held)] == held, "the prompt does not extend the conversation"
        held = prompt + ids
        answers.put(TENANT, prompt, key, ids)
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": follow_up}]
    assert _prompt(tok, answers, messages)[:len(held)] == held
    # another tenant's render does not see them
    assert tok.chat(messages, answer_tokens=lambda k, p: answers.get("bob", k, p)) == \
        tok.chat(messages)
