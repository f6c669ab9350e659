"""OmegaConf resolvers the configs use, registered by ``import fp4moe`` so that they exist before any composition.

``${fp4moe.requeue_flags:<bool>}``: ``cluster.requeue`` as sbatch flags for a launcher profile's
``additional_parameters``: ``{requeue: true}`` (``#SBATCH --requeue``) or ``{no_requeue: true}`` (``--no-requeue``).

``${fp4moe.dirname:<text>}``: ``text`` as one path component: kept when short, else its first 80 characters and a
12-digit hash of the whole (a multirun cell's ``override_dirname`` grows past the file-name limit of 255 bytes).

``${fp4moe.kernel_env:<switch>}``: a kernel switch's ``FP4MOE_*`` variable, else its default
(fp4moe_kernels.switches.env_value, the one place those variables are read): conf/kernels/default.yaml.

``${fp4moe.run_name:}``: the trainer's run folder name, ``<model>-<precision>-<recompute>-<hash of the config>``
(fp4moe.runs.folder: the same config gives the same folder, so the same command resumes a stopped run).

``${fp4moe.export_lines:${cluster.env}}`` and ``${fp4moe.sbatch_value:<value>}``: a launcher profile's ``export``
lines, shell-quoted, and its ``#SBATCH`` values, refused when they hold a line break (fp4moe.launch.shell).

``${fp4moe.config_groups:}``: the trainer's ``--help`` list of config groups, one ``group: option, ...`` line each,
as Hydra lists them (``$APP_CONFIG_GROUPS``) less the schemas of fp4moe.settings.SCHEMAS (``base_model``: the files
extend them; picking one is refused) and the ``hydra/`` groups (conf/train.yaml, ``hydra.help``).
"""
from __future__ import annotations

from typing import Any


def requeue_flags(requeue: Any) -> dict[str, bool]:
    if not isinstance(requeue, bool):
        raise ValueError(f"cluster.requeue must be true or false, not {requeue!r}")
    return {"requeue": True} if requeue else {"no_requeue": True}


DIRNAME_MAX = 120


def dirname(text: Any) -> str:
    import hashlib

    text = str(text).replace("/", "_")
    if len(text.encode()) <= DIRNAME_MAX:
        return text
    return f"{text[:80]}...{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def config_groups() -> str:
    from hydra.core.global_hydra import GlobalHydra

    from fp4moe.settings import SCHEMAS

    if not GlobalHydra.instance().is_initialized():  # read outside a Hydra app (a saved config resolved whole)
        return "(the groups of conf/: python -m fp4moe.train --help)"
    loader = GlobalHydra.instance().config_loader()
    lines = []

    def walk(parent: str) -> None:
        for name in sorted(loader.list_groups(parent)):
            group = f"{parent}/{name}" if parent else name
            if group == "hydra":
                continue
            options = [o for o in loader.get_group_options(group) if o not in SCHEMAS.get(group, {})]
            if options:
                lines.append(f"{group}: {', '.join(options)}")
            walk(group)

    walk("")
    return "\n".join(lines)


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("fp4moe.requeue_flags"):
        OmegaConf.register_new_resolver("fp4moe.requeue_flags", requeue_flags)
    if not OmegaConf.has_resolver("fp4moe.dirname"):
        OmegaConf.register_new_resolver("fp4moe.dirname", dirname)
    if not OmegaConf.has_resolver("fp4moe.kernel_env"):
        from fp4moe_kernels.switches import env_value  # torch-free: the kernel switches' variables, read there only

        OmegaConf.register_new_resolver("fp4moe.kernel_env", env_value)
    if not OmegaConf.has_resolver("fp4moe.run_name"):
        from fp4moe.runs import folder

        OmegaConf.register_new_resolver("fp4moe.run_name", folder.resolver)
    from fp4moe.launch import shell

    if not OmegaConf.has_resolver("fp4moe.export_lines"):
        OmegaConf.register_new_resolver("fp4moe.export_lines", shell.export_lines)
    if not OmegaConf.has_resolver("fp4moe.sbatch_value"):
        OmegaConf.register_new_resolver("fp4moe.sbatch_value", shell.sbatch_value)
    if not OmegaConf.has_resolver("fp4moe.config_groups"):
        OmegaConf.register_new_resolver("fp4moe.config_groups", config_groups)
