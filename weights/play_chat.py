"""The Shakespeare model's chat template: a conversation as a play's lines.

The corpus writes a speech as its speaker's name in capitals with a full stop on a line of its
own, the speech below, a blank line after ("ROMEO.\\nBut, soft! what light ..."); stage
directions in brackets ("[Enter Juliet.]"). So the template writes each message that way: the
user's as ROMEO's, the assistant's as JULIET's (chat_template_kwargs `user_speaker` and
`assistant_speaker` change them; a message's `name` is its speaker), a system message as a
stage direction, a tool's answer as a MESSENGER's, and opens JULIET's speech for the model to
write. A client that wants one speech back stops at "\\n\\n", where the corpus ends one.

weights/train.py writes it into every folder it trains; `python -m weights.play_chat FOLDER`
adds it to a folder trained before (`make serve MODEL=shakespeare` does).
"""

from __future__ import annotations

import argparse
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"

PLAY_TEMPLATE = """\
{#- A conversation as a play's lines, as the Shakespeare corpus writes them (weights/play_chat.py). -#}
{%- set user = (user_speaker or 'Romeo') | upper %}
{%- set assistant = (assistant_speaker or 'Juliet') | upper %}
{%- for message in messages %}
    {%- if message.role in ['system', 'developer'] %}
        {{- '[' + message.content + ']\\n\\n' }}
    {%- else %}
        {%- if message.name %}
            {%- set speaker = message.name | upper %}
        {%- elif message.role == 'user' %}
            {%- set speaker = user %}
        {%- elif message.role == 'tool' %}
            {%- set speaker = 'MESSENGER' %}
        {%- else %}
            {%- set speaker = assistant %}
        {%- endif %}
        {{- speaker + '.\\n' + message.content + '\\n\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- assistant + '.\\n' }}
{%- endif %}
"""


def write_template(folder: Path, replace: bool = False) -> bool:
    """Writes the template into `folder`; False if one was there already (and not `replace`d)."""
    path = Path(folder) / TEMPLATE_FILE
    if path.exists() and not replace:
        return False
    path.write_text(PLAY_TEMPLATE, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Give a Shakespeare model folder its chat template (a play's lines).")
    parser.add_argument("folder", type=Path)
    parser.add_argument("--replace", action="store_true", help="write it even over a template already there")
    args = parser.parse_args(argv)
    written = write_template(args.folder, args.replace)
    print(f"{args.folder / TEMPLATE_FILE}: {'written' if written else 'already there (--replace to overwrite)'}")


if __name__ == "__main__":
    main()
