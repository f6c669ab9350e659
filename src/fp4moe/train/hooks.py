"""What runs after each optimizer step, in this order: evaluation, MLflow, the progress bar, the profiler window,
the caller's ``after_step``, the hooks of ``train.hooks`` (yours), the periodic checkpoint, and the stop signals.

Each hook is a callable taking the :class:`LoopState`; the trainer builds the list once (fp4moe.train.loop) and calls
every hook on every rank after every step. A hook may add metrics before the MLflow hook logs them (evaluation adds
``eval_loss``), save a checkpoint (``state.save()``), or end the loop (``state.stopped_by``).

``train.hooks`` is the trainer's extension point (docs/training.md, "Hooks of your own"): a mapping of names to
importable hook factories, ``name: "package.module:factory"`` or ``name: {factory: "package.module:factory",
<keyword>: <value>, ...}`` (null: no hook, e.g. to switch off one an experiment sets). Each factory is called once per
process before the model is built, as ``factory(cfg, **keywords)`` with the composed config, and returns a
:data:`Hook`. :func:`configured` resolves the entries (import, attribute, signature; a mistake is a one-line
ConfigError naming the key and the fix, from ``fp4moe.train.loop.preflight``), :func:`from_config` calls the
factories. The tests inject their faults this way (tests/faults.py: fail at a step, sleep after each step).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fp4moe.config import ConfigError
from fp4moe.launch import slurm

log = logging.getLogger("fp4moe.train")

Hook = Callable[["LoopState"], None]


@dataclass
class LoopState:
    """The loop between steps: ``step`` (updates done), ``total_steps``, ``metrics`` of the step just done,
    ``last_saved`` / ``last_eval`` (the step of the newest checkpoint / evaluation of this process, -1: none),
    ``stopped_by`` (the stop signal's number, 0: none), ``save`` (writes a checkpoint at ``step``, returns its
    folder), ``checkpoint`` (the newest this process wrote), ``eval_losses`` (step -> held-out loss) and
    ``seconds`` (the step's wall time)."""
    step: int
    total_steps: int
    save: Callable[[], Path]
    metrics: dict[str, float | None] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    last_saved: int = -1
    last_eval: int = -1
    stopped_by: int = 0
    checkpoint: Path | None = None
    seconds: float = 0.0

    def checkpoint_now(self) -> None:
        """A checkpoint at ``step`` unless this process wrote one there already."""
        if self.last_saved != self.step:
            self.checkpoint = self.save()
            self.last_saved = self.step


def evaluation(every: int | None, evaluate: Callable[[], float]) -> Hook:
    """Held-out loss every ``every`` steps and at the last (None: never), as ``eval_loss`` in the step's metrics."""
    def hook(s: LoopState) -> None:
        if every and (s.step % int(every) == 0 or s.step == s.total_steps):
            s.metrics["eval_loss"] = s.eval_losses[s.step] = evaluate()
            s.last_eval = s.step
    return hook


def mlflow_log(tracker: Any, every: int) -> Hook:
    """The step's metrics to MLflow every ``every`` steps, at an evaluation and at the last step."""
    def hook(s: LoopState) -> None:
        if s.step % every == 0 or "eval_loss" in s.metrics or s.step == s.total_steps:
            tracker.log(s.step, s.metrics)
    return hook


def progress_bar(bar: Any, tokens_per_step: int) -> Hook:
    """tqdm's bar (rank 0): loss, lr, this step's tokens/s and the measured tokens/GPU/s."""
    def hook(s: LoopState) -> None:
        m = s.metrics
        tgs = m.get("tokens_per_gpu_per_s")
        bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{tokens_per_step / s.seconds:.0f}",
                        tgs="warm-up" if tgs is None else f"{tgs:.0f}", refresh=False)
        bar.update(1)
    return hook


def profiler_window(profiler: Any, tracker: Any, is_main: bool) -> Hook:
    """Closes the torch.profiler window at its last step; rank 0 tags the run with where it went."""
    def hook(s: LoopState) -> None:
        folder = profiler.after_step(s.step)
        if folder is not None and is_main:
            tracker.set_tags({"profile_dir": str(folder.resolve()), "profile_steps": f"{profiler.first}-{s.step}"})
    return hook


def caller(after_step: Callable[[int, dict[str, float]], None]) -> Hook:
    """The caller's ``after_step(step, metrics)`` (tests send signals from it)."""
    return lambda s: after_step(s.step, s.metrics)


def periodic_checkpoint(every: int | None) -> Hook:
    """A checkpoint every ``every`` steps and at the last (None: only at stops and the end of a resumed run)."""
    def hook(s: LoopState) -> None:
        if every and (s.step % int(every) == 0 or s.step == s.total_steps):
            s.checkpoint = s.save()
            s.last_saved = s.step
    return hook


def stop_signals(stop: slurm.Preemption, device: Any, resume_hint: str) -> Hook:
    """A stop signal since the last step (SIGTERM, SIGINT, SIGUSR1, Slurm's SIGUSR2; ``stop.poll`` agrees on it
    across ranks): checkpoint now, say where and how to go on, end the loop."""
    def hook(s: LoopState) -> None:
        sig = stop.poll(device)
        if sig:
            s.checkpoint_now()
            s.stopped_by = sig
            log.warning("stopped by signal %d at step %d; checkpoint %s; %s", sig, s.step, s.checkpoint,
                        "requeued: the job resumes from it" if stop.will_requeue(sig) else resume_hint)
    return hook


# ---------------------------------------------------------------------------------------------- train.hooks

KEY = "train.hooks"
FORM = ("'package.module:factory' or {factory: 'package.module:factory', <keyword>: <value>, ...} (docs/training.md, "
        "\"Hooks of your own\")")


@dataclass(frozen=True)
class HookFactory:
    """One entry of ``train.hooks``: ``key`` (``train.hooks.<name>``), ``spec`` (``package.module:factory``), the
    ``factory`` it names and the ``keywords`` it is called with after the config."""
    key: str
    spec: str
    factory: Callable[..., Any]
    keywords: dict[str, Any]

    def build(self, cfg: Any) -> Hook:
        """``factory(cfg, **keywords)``, which must return a hook; a ValueError it raises (a keyword out of range) is a
        ConfigError naming the key."""
        try:
            hook = self.factory(cfg, **self.keywords)
        except ConfigError as e:
            raise ConfigError(f"{self.key}: {e}") from None
        except ValueError as e:
            raise ConfigError(f"{self.key}: {self.spec} refused its arguments: {type(e).__name__}: {e}") from None
        if not callable(hook):
            raise ConfigError(f"{self.key}: {self.spec} returned {type(hook).__name__}, not a hook: a factory returns "
                              "a callable taking the trainer's LoopState (fp4moe.train.hooks)")
        return hook


def _split(key: str, entry: Any) -> tuple[str, dict[str, Any]]:
    """An entry's ``package.module:factory`` and its keywords, or ConfigError."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(entry):
        entry = OmegaConf.to_container(entry, resolve=True)
    if isinstance(entry, dict):
        keywords = {str(k): v for k, v in entry.items() if k != "factory"}
        spec = entry.get("factory")
        if not isinstance(spec, str):
            raise ConfigError(f"{key}={entry!r} names no factory: use {FORM}")
    elif isinstance(entry, str):
        spec, keywords = entry, {}
    else:
        raise ConfigError(f"{key}={entry!r}: use {FORM}")
    module, sep, attr = spec.partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise ConfigError(f"{key}={spec!r}: name the factory as 'package.module:factory' (the module's dotted name, a "
                          "colon, the attribute)")
    return spec, keywords


def _resolve(key: str, spec: str, keywords: dict[str, Any]) -> Callable[..., Any]:
    """The factory ``spec`` names, checked to take ``(cfg, **keywords)``, or ConfigError."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"{key}={spec!r}: no module named {e.name!r} here: install it, or put the folder that "
                              "holds it on PYTHONPATH (a Slurm job inherits the environment it is submitted from)"
                              ) from None
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module's own mistake, named in one line
        raise ConfigError(f"{key}={spec!r}: importing {module_name} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            near = difflib.get_close_matches(part, [n for n in dir(factory) if not n.startswith("_")], n=1)
            hint = f" (did you mean {module_name}:{near[0]}?)" if near else ""
            raise ConfigError(f"{key}={spec!r}: {module_name} has no attribute {attr!r}{hint}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConfigError(f"{key}={spec!r} is a {type(factory).__name__}, not a factory: name a function (or class) "
                          "called as factory(cfg, **keywords) that returns a hook")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return factory
    try:
        signature.bind(None, **keywords)
    except TypeError as e:
        given = ", ".join(["cfg", *(f"{k}={v!r}" for k, v in keywords.items())])
        plain = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                  return_annotation=signature.empty)  # the names, not the annotations' strings
        raise ConfigError(f"{key}={spec!r}: {attr}{plain} cannot be called as {attr}({given}) ({e}): a hook "
                          "factory takes the composed config, then the entry's other keys as keyword arguments"
                          ) from None
    return factory


def configured(cfg: Any) -> list[HookFactory]:
    """The entries of ``train.hooks`` in order (null ones left out), each imported and checked against its keywords;
    nothing called. ConfigError (one line: the key, the value, the fix) for the first that cannot be."""
    from omegaconf import DictConfig, OmegaConf

    entries = OmegaConf.select(cfg, KEY, default=None)
    if entries is None:
        return []
    if not isinstance(entries, (DictConfig, dict)):
        shown = OmegaConf.to_container(entries) if OmegaConf.is_config(entries) else entries
        raise ConfigError(f"{KEY}={shown!r}: use a mapping of names to hook factories, each {FORM}; e.g. "
                          f"+{KEY}.mine=package.module:factory")
    out = []
    for name in entries:
        entry = entries[name]
        if entry is None:
            continue
        key = f"{KEY}.{name}"
        spec, keywords = _split(key, entry)
        out.append(HookFactory(key, spec, _resolve(key, spec, keywords), keywords))
    return out


def from_config(cfg: Any) -> list[Hook]:
    """The hooks of ``train.hooks``: each factory of :func:`configured` called once with ``cfg``."""
    return [f.build(cfg) for f in configured(cfg)]


__all__ = ["FORM", "Hook", "HookFactory", "KEY", "LoopState", "caller", "configured", "evaluation", "from_config",
           "mlflow_log", "periodic_checkpoint", "profiler_window", "progress_bar", "stop_signals"]
