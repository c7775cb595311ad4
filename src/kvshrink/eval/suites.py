"""Suites: which tasks run at which lengths, depths and sample counts."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .tasks import AGREEMENT_DOMAINS, RULER_SUBTASKS, TASKS


@dataclass(frozen=True)
class TaskPlan:
    lengths: tuple[int, ...]
    samples: int = 1
    depths: tuple[float, ...] = ()           # niah only (percent)
    subtasks: tuple[str, ...] = ()           # ruler subtasks / agreement domains
    new_tokens: int | None = None            # agreement: decode length; cost: decode tokens
    repeats: int = 1                         # cost only


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: dict[str, TaskPlan] = field(default_factory=dict)
    ppl_tokens: int = 128


SUITES: dict[str, Suite] = {
    # Smoke test, and the CI model test: well under 5 minutes for full+streaming on 2 cores.
    "quick": Suite("quick", {
        "niah": TaskPlan((512, 1024), depths=(0, 50, 100)),
        "ruler": TaskPlan((512,), subtasks=RULER_SUBTASKS),
        "ppl": TaskPlan((1024,)),
        "agreement": TaskPlan((256,), subtasks=AGREEMENT_DOMAINS, new_tokens=24),
        "cost": TaskPlan((512, 1024), new_tokens=8, repeats=1),
    }, ppl_tokens=32),
    # README figures. 8000 rather than 8192 so the answer still fits the model's 8192 positions.
    "standard": Suite("standard", {
        "niah": TaskPlan((2048, 4096, 8000), depths=(0, 25, 50, 75, 100)),
        "ruler": TaskPlan((2048, 4096, 8000), subtasks=RULER_SUBTASKS),
        "ppl": TaskPlan((2048, 4096, 8000)),
        "agreement": TaskPlan((1024,), subtasks=AGREEMENT_DOMAINS, new_tokens=128),
        "cost": TaskPlan((2048, 4096, 8000), new_tokens=32, repeats=3),
    }, ppl_tokens=128),
}


def resolve_suite(name: str, tasks: list[str] | None = None, lengths: list[int] | None = None,
                  depths: list[float] | None = None, samples: int | None = None,
                  new_tokens: int | None = None, repeats: int | None = None,
                  subtasks: list[str] | None = None) -> Suite:
    """The suite restricted to ``tasks`` with the user's overrides. ``lengths`` applies to every task
    but ``agreement``, whose prompts stay short (decode drift is what it measures); ``subtasks``
    restricts ``ruler`` and ``agreement`` (each keeps the names it knows; a name neither knows is an
    error)."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; allowed: {', '.join(SUITES)}")
    suite = SUITES[name]
    chosen = list(suite.tasks) if not tasks else tasks
    for task in chosen:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    for value, what in ((samples, "--samples"), (new_tokens, "--agreement-tokens"), (repeats, "--repeats")):
        if value is not None and value < 1:
            raise ValueError(f"{what} must be at least 1, got {value}")
    if lengths is not None and any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive, got {lengths}")
    if depths is not None and any(not 0 <= d <= 100 for d in depths):
        raise ValueError(f"depths are percentages in [0, 100], got {depths}")
    if subtasks is not None:
        known = set(RULER_SUBTASKS) | set(AGREEMENT_DOMAINS)
        unknown = [t for t in subtasks if t not in known]
        if unknown or not subtasks:
            raise ValueError(f"unknown subtask(s) {unknown}; RULER: {', '.join(RULER_SUBTASKS)}; "
                             f"agreement: {', '.join(AGREEMENT_DOMAINS)}")
    plans = {}
    for task in chosen:
        plan = suite.tasks[task]
        if lengths is not None and task != "agreement":
            plan = replace(plan, lengths=tuple(lengths))
        if depths is not None and task == "niah":
            plan = replace(plan, depths=tuple(depths))
        if samples is not None and task != "cost":
            plan = replace(plan, samples=samples)
        if new_tokens is not None and task == "agreement":
            plan = replace(plan, new_tokens=new_tokens)
        if repeats is not None and task == "cost":
            plan = replace(plan, repeats=repeats)
        if subtasks is not None and task in ("ruler", "agreement"):
            kept = tuple(t for t in plan.subtasks if t in subtasks)
            if not kept and tasks:
                raise ValueError(f"none of the subtasks {subtasks} belongs to {task}: {', '.join(plan.subtasks)}")
            if not kept:
                continue  # the suite's default tasks: the chosen subtasks all belong to the other one
            plan = replace(plan, subtasks=kept)
        plans[task] = plan
    return Suite(suite.name, plans, suite.ppl_tokens)
