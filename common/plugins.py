"""The plug-in points' registries and their one class-path syntax.

Each plug-in point has one registry here, built-in name -> ``"package.module:Class"``, read by
the run config's validation (``common.config``) and by the code that builds the plug-in
(``strategies.aggregators``, ``strategies.refinement``, ``common.weights``). Names are data:
nothing is imported until a plug-in is built, so a POPri run pulls in trl and a FedAvg run
does not. Any other class is named by path, ``"package.module:Class"`` (the entry-point form
Python packaging uses); the dotted form ``"package.module.Class"`` is still accepted, with a
note that says how to write it.
"""

from __future__ import annotations

import importlib

from common.logs import get_logger

log = get_logger(__name__)

AGGREGATORS: dict[str, str] = {
    "fedavg": "flwr.serverapp.strategy:FedAvg",
    "fedavgm": "flwr.serverapp.strategy:FedAvgM",
    "fedadam": "flwr.serverapp.strategy:FedAdam",
    "fedyogi": "flwr.serverapp.strategy:FedYogi",
    "fedadagrad": "flwr.serverapp.strategy:FedAdagrad",
    "fedmedian": "flwr.serverapp.strategy:FedMedian",
    "fedtrimmedavg": "flwr.serverapp.strategy:FedTrimmedAvg",
}
REFINEMENTS: dict[str, str] = {
    "knn-vote": "strategies.knn_vote:KnnVoteRefinement",
    "uniform": "strategies.knn_vote:UniformRefinement",
    "none": "strategies.knn_vote:NoRefinement",
    "contrastive-vote": "strategies.knn_vote:ContrastiveVoteRefinement",
    "pe": "strategies.private_evolution:PrivateEvolution",
    "pe-contrastive": "strategies.private_evolution:ContrastivePrivateEvolution",
    "popri": "strategies.popri:POPri",
    "grpo": "strategies.grpo:GRPO",
}
# Not classes: what phase 1 trains (common.weights.prepare_model); a node's policy lists the
# ones it allows (fedsyn_client.policy).
FINETUNE_MODES: tuple[str, ...] = ("lora", "full")


def is_class_path(value: str) -> bool:
    """True when ``value`` has the shape of a class path (``a.b:C`` or the older ``a.b.C``)."""
    module, sep, name = value.partition(":")
    if sep:
        return bool(module) and name.isidentifier()
    parts = value.split(".")
    return len(parts) >= 2 and all(p.isidentifier() for p in parts)


def resolve(name: str, registry: dict[str, str], kind: str) -> str:
    """``"package.module:Class"`` for a built-in ``name`` of ``registry`` or a class path;
    ``ValueError`` naming the choices otherwise. The dotted form is logged with the fix."""
    if name in registry:
        return registry[name]
    if not is_class_path(name):
        raise ValueError(f"{kind} {name!r} is unknown; choose one of {sorted(registry)} "
                         "or a class path 'package.module:Class'")
    if ":" in name:
        return name
    module, _, cls = name.rpartition(".")
    log.info("%s %r: class paths are written 'package.module:Class' (%s:%s); the dotted form still works",
             kind, name, module, cls)
    return f"{module}:{cls}"


def load_class(name: str, registry: dict[str, str], kind: str, base: type) -> type:
    """The class ``name`` stands for (a built-in of ``registry`` or a class path), checked to be a
    subclass of ``base``; ``ValueError`` naming the problem and the fix otherwise."""
    path = resolve(name, registry, kind)
    module_name, _, cls_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{kind} {name!r}: cannot load {path} ({err}); the module must be importable where the "
                         "ServerApp runs (inside the app folder, or installed)") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{kind} {name!r}: {path} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls
