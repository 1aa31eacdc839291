"""Golden files: make rendered text machine-independent before comparing it.

`neutral_text(text, {value: placeholder})` replaces machine-specific values (the run dir, the
working directory, the interpreter, a socket path, a token, a digest) with placeholders. A
plain `str.replace` chain is order-dependent and matches inside longer paths: with the working
directory `/x/nc` replaced first, the interpreter `/x/nc/.venv/bin/python` (venv inside the
checkout) came out as `WORKDIR/.venv/bin/python`, and `/x/nc-venv/bin/python` (venv beside it
with a shared prefix) as `WORKDIR-venv/bin/python`, instead of `PYTHON`. Here every value is
replaced as a whole token (not when a file-name character continues it on either side) and,
where several match at one position, the longest wins, in one pass (a placeholder is never
rewritten again)."""

from __future__ import annotations

import re
from collections.abc import Mapping

# Characters that continue a file name or token: a value followed or preceded by one of these
# is part of a longer name (`/x/nc` in `/x/nc-venv`, `/work` in `/tmp/work`), not a match.
_NAME_CHAR = r"[\w.\-]"


def neutral_text(text: str, placeholders: Mapping[str, str]) -> str:
    """`text` with each key of `placeholders` replaced by its value (see the module docstring).
    Empty keys are ignored."""
    keys = sorted((k for k in placeholders if k), key=len, reverse=True)
    if not keys:
        return text
    pattern = re.compile(
        rf"(?<!{_NAME_CHAR})(?:{'|'.join(re.escape(k) for k in keys)})(?!{_NAME_CHAR})")
    return pattern.sub(lambda m: placeholders[m.group(0)], text)
