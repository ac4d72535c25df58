"""Reasoning text split from the answer: models whose chat template thinks in `<think>...</think>` (Qwen3,
DeepSeek-R1 and their distills) write their reasoning first. The template may open the block itself (the prompt
ends with `<think>`), or the model opens it as its first output. Used by the Responses API (reasoning items) and
the Anthropic Messages API (thinking blocks); fed the text as it streams, it holds back only what may be the start
of a marker."""

from __future__ import annotations

START, END = "<think>", "</think>"


def template_thinks(template: object) -> bool:
    """Whether a chat template knows think blocks (only then is output split)."""
    return template is not None and END in str(template)


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of text could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """feed(text) -> [("reasoning" | "text", piece), ...] in order; finish() flushes what was held back."""

    def __init__(self, opened_by_prompt: bool):
        self.state = "reasoning" if opened_by_prompt else "start"
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":  # may the output open a think block?
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf, self.state = head[len(START):], "reasoning"
                elif START.startswith(head) and not final:
                    return out
                else:
                    self.state = "text"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(END):], "after"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, END)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            elif self.state == "after":  # the blank lines between </think> and the answer are neither
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    return out
                self.state = "text"
            else:
                if self.buf:
                    out.append(("text", self.buf))
                    self.buf = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        return self.feed("", final=True)
