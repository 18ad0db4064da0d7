"""Every key of a trainer's config in one class: what an export does with a base config's keys.

A trainer's config holds hundreds of keys and gains more each release; autotune's tables name
the few it tunes. Each other key the trainer's own schema has is declared, once, in one class
beside the adapter (trainers/classes_<trainer>.py), with a one-line reason:

- a **knob key**: in the adapter's tables (its knobs, critic, derived keys, companions,
  settings, topology and model keys): written and compared by the export as before;
- **checked**: a key the adapter's own rules already read and compare (an algorithm, a
  critic's model, padding removal);
- **compared**: a setting that changes what a probe measures (memory or time): a base value
  outside the values the probe's run equals is refused, or with --force stated in the
  file's header as unmeasured;
- **inert**: a setting that does not change what a probe measures (paths, logging, learning
  rates, seeds, schedules, rewards, validation).

A base key in no class (a newer trainer's, a fork's) is never passed through silently: the
header states it as not compared, and `export --strict` refuses it. Patterns are
`fnmatch.fnmatchcase` over dotted keys (`*` crosses dots). Pure data and arithmetic.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

KeyClass = Literal["knob", "checked", "compared", "inert"]


@dataclass(frozen=True)
class Compared:
    """A setting that changes the probe's memory or time: `values` are those the probe's
    run equals (None: the key unset or null, where the trainer's default is what ran)."""

    pattern: str
    values: tuple[Any, ...]
    why: str
    cpu_values: tuple[Any, ...] | None = None  # where they differ, those a CPU study's
    # probes equal (fp32 compute on the CPU: TRL's bf16 false, use_cpu true)

    def ran(self, on_cpu: bool = False) -> tuple[Any, ...]:
        """The values the probes' run equals (`on_cpu`: a study whose probes ran on a CPU)."""
        return self.cpu_values if on_cpu and self.cpu_values is not None else self.values

    def measured(self, value: Any, on_cpu: bool = False) -> bool:
        """Whether a base config's `value` is one the probe's run equals."""
        return any(same(value, accepted) for accepted in self.ran(on_cpu))


def same(have: Any, value: Any) -> bool:
    """Whether the user's value is the study's (true is not 1 here, 0.6 is 0.6)."""
    return bool(have == value) and isinstance(have, bool) == isinstance(value, bool)


@dataclass(frozen=True)
class KeyClasses:
    """One trainer's declaration: (pattern, reason) for checked and inert keys, Compared
    for the settings compared with the study."""

    source: str = ""  # the schema the declaration covers (trainer, version or commit)
    checked: tuple[tuple[str, str], ...] = ()
    compared: tuple[Compared, ...] = ()
    inert: tuple[tuple[str, str], ...] = ()

    def matches(self, key: str) -> list[tuple[KeyClass, str | Compared]]:
        """Every declaration `key` falls under (exactly one, where the table is right)."""
        found: list[tuple[KeyClass, str | Compared]] = []
        found += [("checked", why) for pattern, why in self.checked
                  if fnmatch.fnmatchcase(key, pattern)]
        found += [("compared", rule) for rule in self.compared
                  if fnmatch.fnmatchcase(key, rule.pattern)]
        found += [("inert", why) for pattern, why in self.inert
                  if fnmatch.fnmatchcase(key, pattern)]
        return found

    def classify(self, key: str) -> tuple[KeyClass, str | Compared] | None:
        """The class of `key` and its reason (its Compared rule), or None: not declared."""
        found = self.matches(key)
        return found[0] if found else None


def base_keys(tree: Any, declared: KeyClasses, knob_keys: frozenset[str],
              prefix: str = "") -> Iterator[tuple[str, Any, tuple[KeyClass, Any] | None]]:
    """Each key a base config sets, with its value and class: a mapping is walked into unless
    its own key is declared (a dict-valued field such as TRL's model_init_kwargs is one
    setting); a leaf no declaration covers comes with None."""
    if not hasattr(tree, "items"):
        return
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if key in knob_keys:
            yield key, value, ("knob", "")
            continue
        found = declared.classify(key)
        if found is not None:
            yield key, value, found
        elif hasattr(value, "items") and value:
            yield from base_keys(value, declared, knob_keys, f"{key}.")
        elif not any(k.startswith(f"{key}.") for k in knob_keys):
            yield key, value, None
