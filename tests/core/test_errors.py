"""``framework.errors.brief``: how fw quotes a library's exception inside its own message."""

from framework.errors import brief


def test_brief_keeps_the_type_and_the_first_line_only():
    assert brief(RuntimeError("NCCL error in: ...\n  long trace\n  more")) == "RuntimeError: NCCL error in: ..."
    assert brief(ValueError()) == "ValueError: "
