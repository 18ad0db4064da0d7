"""Export: a measured config as a YAML file the trainer takes as is.

With `--base-config`, the user's own trainer YAML is loaded round-trip (ruamel.yaml): only the
tuned keys and their companions change; comments, key order and every other key stay. Without
it, the trainer's tree holds just the tuned keys, companions and topology. The trainer's own
rules (its adapter's) are checked for the topology first; a config it would reject is never
written. Provenance goes on top as comments. Nothing already there is overwritten.
"""

from __future__ import annotations

import io
import re
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from autotune.config import Knobs, Topology, describe_engine, format_bytes
from autotune.errors import ConfigError
from autotune.trainers.adapter import Adapter, TrainerKeys, TrainerTree, TrainerValue
from autotune.trainers.export_plan import ExportPlan, dotted_get, plan_export, resolved_get

if TYPE_CHECKING:
    from ruamel.yaml import YAML

TrainerYaml = tuple[TrainerTree, str]  # a user's trainer YAML: its round-trip tree, its text
# best.yaml's document (sweep/pick/artifacts.py best_document): what the header says it measured
BestDocument: TypeAlias = dict[str, Any]


def _yaml() -> YAML:
    from ruamel.yaml import YAML

    yaml = YAML()  # round-trip: comments, order and scalar styles are kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # keep long interpolations on one line, as trainers' own files do
    yaml.representer.add_representer(type(None), lambda representer, _: (
        representer.represent_scalar("tag:yaml.org,2002:null", "null")))
    return yaml


def dotted_set(tree: TrainerTree, key: str, value: TrainerValue) -> None:
    from ruamel.yaml.comments import CommentedMap

    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if part not in node or not hasattr(node[part], "get"):
            node[part] = CommentedMap()
        node = node[part]
    node[leaf] = value


def load_trainer_yaml(path: str) -> TrainerYaml:
    """The user's trainer YAML, as a round-trip tree (with line numbers) and as text."""
    from ruamel.yaml.error import YAMLError

    from autotune.files import load_yaml, read_text_file

    text = read_text_file(path, "--base-config")
    load_yaml(text, f"--base-config {path}")  # refuses a key given twice, an anchor bomb
    try:
        tree = _yaml().load(text)
    except (YAMLError, RecursionError) as err:
        raise ConfigError(f"--base-config {path}: not valid YAML ({err})".replace("\n", " ")) \
            from None
    if not hasattr(tree, "get"):
        raise ConfigError(f"--base-config {path}: expected a mapping of trainer keys at the top")
    return tree, text


def scalar_text(value: TrainerValue) -> str:
    if value is None:
        return "null"
    if isinstance(value, str) and misread(value):
        return "'" + value.replace("'", "''") + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


def misread(text: str) -> bool:
    """Whether a YAML 1.1 reader (PyYAML, OmegaConf: what the trainers load with) would not
    read `text`, written plain, back as this string: `no` is false there, `1e-5` a string."""
    from autotune.files import load_yaml

    try:
        return bool(load_yaml(text, "a value") != text)
    except ConfigError:
        return True


def yaml_value(value: TrainerValue) -> TrainerValue:
    """`value` as the tree holds it: a string a YAML 1.1 reader would misread, quoted."""
    from ruamel.yaml.scalarstring import SingleQuotedScalarString

    return SingleQuotedScalarString(value) if isinstance(value, str) and misread(value) \
        else value


def edit_in_place(text: str, tree: TrainerTree, values: TrainerKeys) -> str | None:
    """`text` with each key's scalar replaced on its own line, every other byte kept; None
    when a key is missing or not a one-token scalar (then the tree is re-serialised)."""
    lines = text.splitlines(keepends=True)
    for key, value in values.items():
        *parents, leaf = key.split(".")
        parent = dotted_get(tree, ".".join(parents)) if parents else tree
        if not hasattr(parent, "lc") or leaf not in parent or hasattr(parent[leaf], "items") \
                or isinstance(parent[leaf], list) or isinstance(value, list | tuple):
            return None  # a mapping or a list: the tree is re-serialised
        line, column = parent.lc.value(leaf)
        current, rest = parent[leaf], lines[line][column:]
        if isinstance(current, str) and rest.startswith(current):
            end = len(current)  # a plain string as written: commas and all (q_proj,v_proj; an
            # interpolation); in a flow mapping the comma after it is not the string's
        else:
            token = re.match(r"[^\s#'\",}\]]+(?=[\s,}\]]|$)", rest)
            if token is None:
                return None
            end = token.end()
        written = scalar_text(value)
        if parent.fa.flow_style() and any(mark in written for mark in ",[]{}"):
            return None  # in {a: x, b: y} a comma would end it: the tree is re-serialised
        lines[line] = lines[line][:column] + written + rest[end:]
    return "".join(lines)


def topology_for(adapter: Adapter, tree: TrainerTree | None, nnodes: int | None,
                 gpus_per_node: int | None, fallback: Topology | None = None) -> Topology:
    """Flags first, then the base config's trainer.nnodes / n_gpus_per_node, then `fallback`
    (the study's own topology), then 1 x 1."""
    nodes_key, gpus_key = adapter.topology_keys or ("", "")
    values = []
    for flag, key, default in ((nnodes, nodes_key, fallback.nnodes if fallback else 1),
                               (gpus_per_node, gpus_key, fallback.gpus_per_node if fallback
                                else 1)):
        value = flag or (dotted_get(tree, key) if key else None) or default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}={value!r} in the base config: expected a positive "
                              "integer; write the value out, or pass --nnodes/--gpus-per-node")
        values.append(value)
    return Topology(*values)


def render(adapter: Adapter, knobs: Knobs, topology: Topology,
           base: TrainerYaml | None, provenance: list[str],
           extra: TrainerKeys | None = None, searched: Collection[str] | None = None,
           force: bool = False) -> str:
    """The exported file's text; ConfigError naming every broken rule and every conflict
    with the base config instead (export_plan.py). `extra`: more trainer keys to write as they
    are (a command probe's short-run settings and the space's trainer keys)."""
    plan = plan_export(adapter, knobs, topology, base[0] if base is not None else None,
                       searched, force, extra)
    if plan.problems:
        raise ConfigError(plan.problems)
    return render_plan(plan, adapter, base, provenance)


def render_plan(plan: ExportPlan, adapter: Adapter, base: TrainerYaml | None,
                provenance: list[str]) -> str:
    """The text of a plan without problems: the user's file edited in place where it can
    be (else re-serialised), or the trainer's skeleton with the keys; the header on top."""
    from ruamel.yaml.comments import CommentedMap

    lines = list(provenance)
    tail = [lines.pop()] if lines and not lines[-1] else []
    lines += [plan.batching] if plan.batching else []
    lines += plan.run
    lines += ["UNMEASURED (exported with --force; not the run the study measured):",
              *(f"  {line}" for line in plan.unmeasured)] if plan.unmeasured else []
    lines += ["NOT COMPARED (keys of your base config autotune does not classify: they may "
              "change memory or time; --strict refuses them):",
              *(f"  {line}" for line in plan.not_compared)] if plan.not_compared else []
    if base is not None:
        lines += ["changed from your base config (every other key is as you wrote it):",
                  *plan.changes] if plan.changes else ["nothing changed from your base config"]
    else:
        lines += [adapter.skeleton_note] if adapter.skeleton_note else []
        lines += ["set so the trainer runs the measured shapes:", *plan.changes] \
            if plan.changes else []
    header = "".join(f"# {line}\n" if line else "#\n" for line in lines + tail)
    edited = edit_in_place(base[1], base[0], plan.values) if base is not None else None
    if edited is not None:
        return header + edited
    tree = base[0] if base is not None else CommentedMap()
    for key, value in (adapter.skeleton or {}).items() if base is None else ():
        tree[key] = value
    for key, value in plan.values.items():
        dotted_set(tree, key, yaml_value(value))
    buffer = io.StringIO()
    _yaml().dump(tree, buffer)
    return header + buffer.getvalue()


def provenance_lines(document: BestDocument, adapter: Adapter, topology: Topology
                     ) -> list[str]:
    measured, prov = document["measured"], document["provenance"]
    versions = prov.get("versions") or {}
    phases = ", ".join(f"{p} {format_bytes(v)}" for p, v in
                       measured["phase_peak_mem_bytes"].items())
    command = prov.get("command")
    if command:  # a command probe: the user's own trainer, measured from outside
        how = [f"measured by {command['steps']}-step runs of your {command['trainer']} launch "
               f"line on {prov.get('device')}: {command['launch']}"]
    else:
        how = [f"per phase: {phases}", *ranks_lines(document),
               f"measured on {prov.get('device')} with model {prov.get('model')}; torch "
               f"{versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}"]
        if "rollout_engine" in document["config"]:
            how.append("rollout: " + describe_engine(document["config"]["rollout_engine"],
                                                     versions))
    return [f"exported by autotune {versions.get('autotune', '?')} for {adapter.name} on "
            f"{time.strftime('%Y-%m-%d')}",
            f"study {document['study']}, trial {document['trial']}: "
            f"{measured['tokens_per_s']:,.1f} tokens/s, peak "
            f"{format_bytes(measured['peak_mem_bytes'])} of a "
            f"{format_bytes(measured['budget_bytes'])} budget "
            f"({measured['headroom']:.0%} headroom, binds in {measured['binding_phase']})",
            *how,
            *length_lines(document),
            f"checked against {adapter.name}'s rules for {topology.nnodes} node(s) x "
            f"{topology.gpus_per_node} GPU(s)", ""]


def length_lines(document: BestDocument) -> list[str]:
    """How long responses may grow before this config runs out of memory (best.yaml's)."""
    headroom = document.get("length_headroom")
    if not headroom:
        return []
    probed = document["config"].get("max_response_length")
    return [f"length headroom: {headroom['says']} (probed at {probed} tokens; "
            f"{headroom['by']})"]


def ranks_lines(document: BestDocument) -> list[str]:
    """How the ranks were probed: emulated (time without communication), and the real-rank
    confirmation when there was one."""
    topology = document["provenance"]["topology"]
    if topology.get("ranks") != "emulated":
        return []
    lines = ["one emulated rank of the run: per-rank memory exact, tokens/s without "
             "communication"]
    confirmed = document.get("confirmed")
    if confirmed:
        figure = f"{confirmed['tokens_per_s']:,.1f} tokens/s, peak " \
            f"{format_bytes(confirmed['peak_mem_bytes'])} per rank" \
            if confirmed["status"] == "ok" else confirmed["status"]
        lines.append(f"confirmed with {confirmed['world_size']} real ranks: {figure}")
    return lines


def override_line(adapter: Adapter, values: TrainerKeys) -> str:
    """A plan's keys as `key=value` overrides for a launch script (`--key value` for TRL)."""
    if adapter.topology_keys is None:  # HfArgumentParser flags
        return " ".join(f"--{key} {scalar_text(value)}" for key, value in values.items()
                        if value is not None)
    return " ".join(f"{key}={scalar_text(value)}" for key, value in values.items())


def launch_lines(adapter: Adapter, path: Path, values: TrainerKeys, topology: Topology,
                 on_base: bool, launch: str = "") -> list[str]:
    """How to launch the trainer with an exported file: its launch line (`launch`, where the
    plan's is not the adapter's: a recipe's), and the same keys as overrides where the launch
    line does not take them."""
    overrides = override_line(adapter, values)
    launch = launch or adapter.launch
    lines = ["launch: " + launch.format(
        path=path, overrides=overrides, world=topology.world_size,
        folder=path.resolve().parent, name=path.name.removesuffix(".yaml"))]
    if "{overrides}" not in launch:
        lines.append("or as overrides" + (" on your base config" if on_base else "") + ": "
                     + overrides)
    return lines


def override_words(adapter: Adapter, values: TrainerKeys) -> list[str]:
    """A plan's keys as command-line words: `key=value` for the Hydra and OmegaConf
    trainers, `--key value` for TRL's HfArgumentParser."""
    if adapter.topology_keys is None:  # argv words: nothing to quote
        return [word for key, value in values.items() if value is not None
                for word in (f"--{key}", str(value).lower() if isinstance(value, bool)
                             else str(value))]
    return [f"{key}={override_text(value)}" for key, value in values.items()]


def override_text(value: TrainerValue) -> str:
    """A value as a Hydra/OmegaConf override writes it (lists as [a,b])."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_text(item) for item in value) + "]"
    return scalar_text(value)


def trainer_start(adapter: Adapter, base_config: str | None, nnodes: int | None,
                  gpus_per_node: int | None) -> tuple[TrainerYaml | None, Topology, Knobs]:
    """What `run --trainer` starts from: the user's trainer YAML (or none), the topology,
    and the canonical knobs of the starting config (the YAML's, else the trainer's defaults)."""
    from autotune.config import parse_knob_value

    base = load_trainer_yaml(base_config) if base_config else None
    topology = topology_for(adapter, base[0] if base else None, nnodes, gpus_per_node)
    if base is None:
        return None, topology, dict(adapter.defaults or {})
    read = adapter.read_knobs(lambda key, default: resolved_get(base[0], key, default),
                              topology)
    problems: list[str] = []
    knobs: Knobs = {}
    for knob, value in read.items():
        try:
            knobs[knob] = parse_knob_value(knob, value)
        except ConfigError as err:
            where = adapter.keys[knob][0] if knob in adapter.keys else " and ".join(
                next(part.keys for part in adapter.derived if knob in part.knobs))
            problems += [f"{base_config}: {where}: {p}" for p in err.problems]
    if knobs.get("placement") == "separate":  # TRL's vllm_mode: server, say
        where = " and ".join(next(part.keys for part in adapter.derived
                                  if "placement" in part.knobs))
        problems.append(f"{base_config}: {where}: the engine runs on GPUs of its own "
                        "(placement=separate), which a sweep of a trainer's config does not "
                        "probe yet (a split probe runs from a space fixing it, on a CPU): "
                        "sweep a copy that colocates it, and size each side with `autotune "
                        "estimate --set placement=separate --set rollout_gpus=N`")
    if problems:
        raise ConfigError(problems)
    return base, topology, knobs


def load_trainer_yaml_text(text: str) -> TrainerYaml:
    return _yaml().load(text), text


def write_new(path: Path, text: str) -> None:
    """Create `path` with `text`; never replace a file that is already there, never leave a
    half-written one (a full disk), and say in one line why a folder will not take it."""
    from autotune.files import DiskError, describe_os_error

    if not path.parent.is_dir():
        what = "is a file" if path.parent.exists() else "does not exist"
        raise ConfigError(f"--out {path}: folder {path.parent} {what}; create the folder or "
                          "choose another path")
    try:
        handle = open(path, "x")
    except FileExistsError:
        raise ConfigError(f"--out {path}: file exists; choose a new path") from None
    except OSError as exc:
        raise DiskError(describe_os_error(exc, path)) from None
    try:
        with handle:
            handle.write(text)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise DiskError(describe_os_error(exc, path)) from None
