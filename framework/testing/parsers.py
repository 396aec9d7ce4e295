"""The tool-parser conformance kit: streamed in random chunks, a parser assembles what it
parses in one piece."""

from __future__ import annotations


def random_chunks(text: str, seed: int, max_size: int = 13) -> list[str]:
    """``text`` cut into pieces of 1 to ``max_size`` characters, their sizes drawn from
    ``random.Random(seed)``: a stream's deltas as a client might see them."""
    import random

    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        size = rng.randint(1, max_size)
        pieces.append(text[i : i + size])
        i += size
    return pieces


def check_tool_parser_streaming(parser_cls, text: str, tools=None, *, seeds: int = 8):
    """Feed ``text`` to ``parser_cls(tools)`` whole and in random chunkings (``seeds`` of them, 1 to
    13 characters a piece); assert that every chunking's deltas assemble to the one-shot result and
    that each call's first delta, and only it, names the call. Returns the one-shot result."""
    from framework.parsers.base import assemble

    def summary(result):
        return result.content, [(c.name, c.arguments) for c in result.tool_calls]

    one_shot = parser_cls(tools).parse(text)
    for seed in range(seeds):
        parser = parser_cls(tools)
        deltas = [parser.feed(piece) for piece in random_chunks(text, seed)] + [parser.finish()]
        assert summary(assemble(deltas)) == summary(one_shot), f"chunking seed {seed} differs from the one-shot result"
        named = set()
        for delta in deltas:
            for piece in delta.tool_calls:
                assert (piece.name is not None) == (piece.index not in named), f"call {piece.index}: name not first"
                named.add(piece.index)
    return one_shot
