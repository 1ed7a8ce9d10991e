"""What every ``peakflat`` command shares: an argparse parser whose errors are one line, and
overrides (``section.field=value``) in any order among the flags."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad command-line input; its message is the one line to print (``peakflat CMD: ...``)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors as ``UsageError`` (one line, exit status 2, from ``main``)
    instead of a usage block and ``SystemExit``."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser``'s namespace of ``argv`` with overrides and flags in any order: argparse's
    ``nargs="*"`` positionals stop at the first flag, so the ``section.field=value`` words after
    one come back unrecognized and are appended to ``overrides`` here (where the command takes
    them); any other leftover is an error."""
    args, leftovers = parser.parse_known_args(argv)
    overrides = [word for word in leftovers if "=" in word and not word.startswith("-")]
    unknown = [word for word in leftovers if word not in overrides]
    if overrides and not hasattr(args, "overrides"):
        unknown = leftovers
    if unknown:
        command = " ".join([parser.prog, *[w for w in (getattr(args, "command", None),
                                                       getattr(args, "action", None)) if w]])
        raise UsageError(f"{command}: unrecognized arguments: {' '.join(unknown)} (expected "
                         f"flags of `{command} --help` or section.field=value overrides)")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args
