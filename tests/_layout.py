"""The rooms of docs/design.md's layout table and the floor of each."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def floors() -> dict[str, int]:
    """Room -> floor, from the design page's table."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## How the code is laid out", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([^`]+)` \|", section, flags=re.M)
    assert rows, "docs/design.md has no table under 'How the code is laid out'"
    table = {room: int(floor) for floor, room in rows}
    assert len(table) == len(rows), "a room is listed twice"
    return table


def room_of(rel: pathlib.PurePath, table: dict[str, int]) -> str:
    """The room of a module path (`keras_dist/strategies/state/_x.py`): the
    longest folder of the table that holds it, or the module itself."""
    text = str(rel)
    if text in table:
        return text
    parts = rel.parts
    for end in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:end]) + "/"
        if folder in table:
            return folder
    raise AssertionError(f"{text} is in no room of docs/design.md's table")
