"""The Shakespeare model's chat template: a conversation written as the corpus writes a play."""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerFast

from service.http.chat_template import DEFAULT_SPECIAL_TOKENS, ChatTemplate
from tests.conftest import DEFAULT_MODEL_DIR
from weights.play_chat import PLAY_TEMPLATE, TEMPLATE_FILE, main, write_template

SCENE = [
    {"role": "system", "content": "A garden, by moonlight."},
    {"role": "user", "content": "Dost thou love me?"},
    {"role": "assistant", "content": "Ay, with all my heart."},
    {"role": "user", "content": "Then swear it.", "name": "Romeo"},
]
# How the corpus writes a speech: the speaker's name in capitals and a full stop, alone on its
# line, the speech below, a blank line after; a stage direction in brackets.
SPEECH = re.compile(r"^([A-Z][A-Z ]*)\.\n((?:.+\n)+)\n", re.M)


def render(messages=SCENE, **kwargs) -> str:
    return ChatTemplate(PLAY_TEMPLATE, DEFAULT_SPECIAL_TOKENS, "play").render(messages, **kwargs)


def test_a_conversation_is_written_as_a_play():
    text = render()
    assert text.startswith("[A garden, by moonlight.]\n\n")
    speeches = SPEECH.findall(text)
    assert speeches == [("ROMEO", "Dost thou love me?\n"), ("JULIET", "Ay, with all my heart.\n"),
                        ("ROMEO", "Then swear it.\n")]
    assert text.endswith("\n\nJULIET.\n")  # the model speaks next, as Juliet


def test_the_speakers_can_be_chosen():
    text = render(kwargs={"user_speaker": "Hamlet", "assistant_speaker": "Horatio"})
    assert [name for name, _ in SPEECH.findall(text)] == ["HAMLET", "HORATIO", "ROMEO"]  # a message's name wins
    assert text.endswith("HORATIO.\n")
    assert render(add_generation_prompt=False).endswith("Then swear it.\n\n")


def test_the_format_is_the_corpus_own():
    # A passage as the corpus has it (Romeo and Juliet, Act II; this edition writes the names in
    # title case, most plays in capitals): the template writes the same text.
    corpus = "Romeo.\nShe speaks:\nO, speak again, bright angel!\n\nJuliet.\nO Romeo, Romeo!\n\n"
    speeches = [{"role": "user", "content": "She speaks:\nO, speak again, bright angel!"},
                {"role": "assistant", "content": "O Romeo, Romeo!"}]
    assert render(speeches, add_generation_prompt=False).lower() == corpus.lower()


def test_rendered_ids_equal_transformers(tokenizer):
    reference = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"), eos_token="<|endoftext|>")
    reference.chat_template = PLAY_TEMPLATE
    for kwargs in ({}, {"user_speaker": "Lear"}):
        expected = reference.apply_chat_template(SCENE, tokenize=True, add_generation_prompt=True, **kwargs)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert tokenizer.encode(render(kwargs=kwargs)) == expected


def test_folders_trained_before_get_it_once(tmp_path, capsys):
    assert write_template(tmp_path)
    (tmp_path / TEMPLATE_FILE).write_text("mine")
    main([str(tmp_path)])
    assert (tmp_path / TEMPLATE_FILE).read_text() == "mine" and "already there" in capsys.readouterr().out
    main([str(tmp_path), "--replace"])
    assert (tmp_path / TEMPLATE_FILE).read_text() == PLAY_TEMPLATE
