"""Server-sent events stay one line per event for clients that split lines like str.splitlines."""
import json

from jaxengine.serve import protocol as p
from jaxengine.serve.openai_serving import _sse

UNUSUAL_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_an_event_whose_text_holds_unusual_line_breaks_is_one_line():
    text = "a" + "b".join(UNUSUAL_BREAKS) + " é\N{SNOWMAN}"
    chunk = p.CompletionResponse(id="cmpl-1", created=0, model="m",
                                 choices=[p.CompletionChoice(index=0, text=text)])
    lines = _sse(chunk).splitlines()
    assert lines[1:] == [""]
    assert lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
