"""What every ``peakflat`` command shares: an argparse parser whose errors are one line, and
overrides (``section.field=value``) in any order among the flags, each flag and override at most
once."""

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
    them); any other leftover is an error, and so is a flag or an override given twice
    (``duplicate``: argparse and the config would keep the last one without a word)."""
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
    if twice := duplicate(parser, args, argv):
        command = " ".join([parser.prog, *[w for w in (getattr(args, "command", None),
                                                       getattr(args, "action", None)) if w]])
        raise UsageError(f"{command}: {twice}: expected each flag and each override at most "
                         f"once (the last would win silently)")
    return args


def _command_parser(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser that took the command's flags: ``peakflat train``'s, ``peakflat xcheck
    run``'s."""
    for name in ("command", "action"):
        choice = getattr(args, name, None)
        subparsers = getattr(parser, "_subparsers", None)
        if choice is None or subparsers is None:
            break
        for action in subparsers._group_actions:
            if isinstance(action, argparse._SubParsersAction) and choice in action.choices:
                parser = action.choices[choice]
    return parser


def duplicate(parser: argparse.ArgumentParser, args: argparse.Namespace,
              argv: list[str]) -> str | None:
    """The words of the first flag (by its action: ``--run-dir`` and ``--run-dir=``) or
    override key given twice in ``argv``, or None; a repeatable flag (``--only``) is no
    duplicate."""
    options = _command_parser(parser, args)._option_string_actions
    seen: dict[object, str] = {}
    for index, word in enumerate(argv):
        if word == "--":
            break
        if not word.startswith("--"):
            continue
        name = word.split("=", 1)[0]
        matches = [action for option, action in options.items() if option == name] or [
            action for option, action in options.items() if option.startswith(name)]
        if len({id(a) for a in matches}) != 1 or isinstance(
                matches[0], argparse._AppendAction | argparse._HelpAction):
            continue
        if "=" not in word and matches[0].nargs != 0 and index + 1 < len(argv):
            word = f"{word} {argv[index + 1]}"  # the flag with its value
        if matches[0] in seen:
            return f"{matches[0].option_strings[-1]} given twice ({seen[matches[0]]} and {word})"
        seen[matches[0]] = word
    keys: dict[str, str] = {}
    for override in getattr(args, "overrides", None) or []:
        key = override.split("=", 1)[0].strip()
        if key in keys:
            return f"{key} given twice ({keys[key]} and {override})"
        keys[key] = override
    return None
