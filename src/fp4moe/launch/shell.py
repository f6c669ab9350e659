"""Config values that reach a line of an sbatch script, made safe for the shell (P10, issue 30).

A Slurm launcher profile (conf/hydra/launcher/) turns config values into two kinds of script lines:

- ``export KEY=VALUE`` lines (the profile's ``setup``, one per ``cluster.env`` key): ``export_lines`` writes every
  value through ``shlex.quote``, so bash sets the variable to exactly that string (quotes, ``$(...)``, backticks,
  ``;`` included) and runs nothing of it;
- ``#SBATCH --key=value`` directives (job name, partition, account, QoS, constraint): submitit quotes the value,
  but a line break in it would end the directive and start a shell line; ``sbatch_value`` refuses one.

Both refuse a line break or another control character (a tab is allowed): sbatch cannot carry one in a directive,
and no Slurm, NCCL or allocator setting needs one in a variable (one there is a paste error).
"""
from __future__ import annotations

import re
import shlex
from typing import Any

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class UnsafeValue(ValueError):
    """A value cannot be written into an sbatch script; the message names the key and the fix."""


def _full_key(node: Any, default: str) -> str:
    try:
        return str(node._get_full_key(None)) or default
    except Exception:  # not an OmegaConf node
        return default


def check_text(key: str, value: Any) -> str:
    """``str(value)``, or UnsafeValue when it holds a control character other than a tab."""
    text = str(value)
    bad = CONTROL.search(text)
    if bad:
        raise UnsafeValue(f"{key}={text!r} holds a control character ({bad.group()!r}, e.g. a line break), which "
                          "cannot go into an sbatch script: remove it (check the environment variable or override "
                          "that sets it)")
    return text


def export_line(key: str, value: Any, where: str = "env") -> str:
    """``export KEY=<value, shlex-quoted>``; UnsafeValue when KEY is not a shell variable name or the value holds
    a control character."""
    if not NAME.fullmatch(str(key)):
        raise UnsafeValue(f"{where}.{key}: not a shell variable name (letters, digits, '_', not starting with a "
                          "digit): rename it")
    return f"export {key}={shlex.quote(check_text(f'{where}.{key}', value))}"


def export_lines(env: Any) -> str:
    """Resolver ``${fp4moe.export_lines:${cluster.env}}``: one ``export`` line per key of ``env`` (a mapping), in
    its order, joined by line breaks (one element of a profile's ``setup`` list: Hydra cannot merge an
    interpolation into submitit's null ``setup``); a null value writes no line (the job's inherited value stays)."""
    where = _full_key(env, "cluster.env")
    return "\n".join(export_line(k, v, where) for k, v in (env or {}).items() if v is not None)


def sbatch_value(value: Any, _node_: Any = None) -> Any:
    """Resolver ``${fp4moe.sbatch_value:<value>}``: ``value`` unchanged (null stays null: no directive), or
    UnsafeValue naming the launcher key when its text holds a control character."""
    if value is not None:
        check_text(_full_key(_node_, "hydra.launcher"), value)
    return value
