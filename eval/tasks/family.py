"""The generated task family: small Python packages, each with one procedural bug whose fix is one line, in the
spirit of SWE-smith's procedural bugs (../shared/reference/task-generation.md), made from a seed at run time.

    from eval.tasks import family as taskgen
    family = taskgen.generate(seed=0)              # {"train": [128 instances], "heldout": [64 instances]}, checked
    edit = taskgen.sed_edit(instance)              # the teacher's one-line sed, derived from the gold patch

Each instance is a SWE-bench 5.x instance (eval/tasks/load.py's shape), repo ``polar-gen/<module>``, instance id
``polar-gen__<module>-<seed>``. Its repository holds ``<module>/core.py`` (the buggy function and a decoy),
``<module>/__init__.py``, a README and ``tests/test_<module>.py`` with the decoy's test (PASS_TO_PASS); the test
patch adds the buggy function's test (FAIL_TO_PASS), whose expected value is computed by running the fixed code.
Nothing is stored: ``repo_files`` makes a repository again from its instance id (the module name says which
split and index it is, the id's tail the seed), so checkouts and exports need only the instance.

Bug kinds (``KINDS``): a wrong constant, a wrong operator, an off-by-one range, swapped arguments, a wrong key,
a wrong comparison, the wrong variable returned, a misspelt string, the wrong index, ``or`` for ``and``. They
cycle with the index, so every kind is in both splits. Issue styles cycle too (shifted each cycle of kinds, so
every kind meets every style), in eighths:
four ``diagnosed`` (names the file and quotes the text to change, exactly as the teacher's sed changes it), two
``values`` (the call, what it returned, what was expected) and two ``symptom`` (what goes wrong, no values); one
of each of the last two pairs does not name the file, so a quarter of the issues do not.

The split is by construction: the two splits draw module, function and constant names, string keys and integer
values from disjoint word lists and ranges; only the templates (bug kinds, parameter names, operators) are
shared. ``check_disjoint`` checks it after generation on the names and values each instance records.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from swebench.harness.constants import EvalType
from unidiff.patch import PatchSet

from eval.tasks.instances import TaskError, base_commit, eval_script, image_tag

__all__ = [
    "KINDS",
    "OWNER",
    "SIZES",
    "SPLITS",
    "SedEdit",
    "check_disjoint",
    "generate",
    "instance_split",
    "repo_files",
    "sed_edit",
    "teacher_messages",
    "words_of",
]

OWNER = "polar-gen"
SPLITS = ("train", "heldout")
SIZES = {"train": 128, "heldout": 64}
STYLES = ("diagnosed", "diagnosed", "diagnosed", "diagnosed", "values", "values", "symptom", "symptom")
UNNAMED = {5, 7}  # positions in STYLES whose issue does not name the file

# Disjoint per split: every name and value an instance chooses comes from its split's lists.
WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "train": {
        "adjective": ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow",
                      "ivory", "jolly", "keen", "lucky", "mellow", "noble", "polite", "quiet"),
        "noun": ("anchor", "basket", "candle", "desk", "engine", "fable", "garden", "harbor",
                 "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pillow"),
        "verb": ("count", "scale", "merge", "shift", "price", "rank", "trim", "weigh"),
        "label": ("apple", "button", "circle", "dragon", "forest", "guitar", "hammer", "letter"),
    },
    "heldout": {
        "adjective": ("rapid", "silent", "tidy", "urban", "vivid", "witty", "young", "zesty",
                      "bold", "crisp", "dim", "frank"),
        "noun": ("quarry", "river", "saddle", "tunnel", "valley", "wagon", "yacht", "zipper",
                 "bridge", "cabin", "dune", "forge"),
        "verb": ("total", "bound", "pick", "mark", "route", "stack", "tally", "clamp"),
        "label": ("mirror", "pepper", "rocket", "summer", "turtle", "velvet", "window", "yellow"),
    },
}  # fmt: skip
VALUES = {"train": range(11, 60), "heldout": range(61, 100)}


@dataclasses.dataclass(frozen=True)
class Bug:
    """One bug of a kind: the function's correct source, the bugged line and its fix, the call that shows it."""

    source: str  # the correct code, appended to core.py
    bugged: str  # a line of ``source`` as the bug has it
    fixed: str  # that line as it should be
    call: str  # the F2P test's call; its value differs before and after the fix
    symptom: str  # what goes wrong, for the "symptom" issue style
    identifiers: tuple[str, ...]
    values: tuple[str, ...]


Pick = Callable[[str], str]  # draws a word of a list of the instance's split


def _constant(fn: str, pick: Pick, nums: list[int]) -> Bug:
    const, (good, bad, arg) = pick("noun").upper() + "_FACTOR", nums[:3]
    return Bug(
        f"{const} = {good}\n\n\ndef {fn}(x):\n    return x * {const}\n",
        f"{const} = {bad}", f"{const} = {good}", f"{fn}({arg})", f"`{fn}` multiplies by the wrong factor.",
        (const,), (str(good), str(bad), str(arg)),
    )  # fmt: skip


def _operator(fn: str, pick: Pick, nums: list[int]) -> Bug:
    # Seeded by the function's name, itself drawn from the instance's seed: templates get words, not the generator.
    good, bad = random.Random(fn).choice([("*", "+"), ("-", "+"), ("+", "-"), ("*", "-")])
    return Bug(
        f"def {fn}(price, count):\n    return price {good} count\n",
        f"    return price {bad} count", f"    return price {good} count", f"{fn}({nums[0]}, {nums[1]})",
        f"`{fn}` combines its two arguments with the wrong arithmetic.", (), (str(nums[0]), str(nums[1])),
    )  # fmt: skip


def _off_by_one(fn: str, pick: Pick, nums: list[int]) -> Bug:
    step = nums[0]
    return Bug(
        f"def {fn}(n):\n    return [{step} * i for i in range(1, n + 1)]\n",
        f"    return [{step} * i for i in range(1, n)]", f"    return [{step} * i for i in range(1, n + 1)]",
        f"{fn}(3)", f"`{fn}(n)` leaves out the last of its n multiples.", (), (str(step),),
    )  # fmt: skip


def _swapped_args(fn: str, pick: Pick, nums: list[int]) -> Bug:
    helper, (step, arg) = f"_{pick('verb')}_{pick('noun')}", nums[:2]
    return Bug(
        f"def {helper}(amount, step):\n    return amount - step\n\n\ndef {fn}(amount):\n"
        f"    return {helper}(amount, {step})\n",
        f"    return {helper}({step}, amount)", f"    return {helper}(amount, {step})", f"{fn}({arg})",
        f"`{fn}` passes its arguments to `{helper}` in the wrong order.", (helper,), (str(step), str(arg)),
    )  # fmt: skip


def _wrong_key(fn: str, pick: Pick, nums: list[int]) -> Bug:
    table, good, bad = pick("noun").upper() + "_TABLE", pick("label"), pick("label")
    while bad == good:
        bad = pick("label")
    return Bug(
        f'{table} = {{"{good}": {nums[0]}, "{bad}": {nums[1]}}}\n\n\ndef {fn}():\n    return {table}["{good}"]\n',
        f'    return {table}["{bad}"]', f'    return {table}["{good}"]', f"{fn}()",
        f"`{fn}` reads the wrong entry of `{table}`.", (table,), (good, bad, str(nums[0]), str(nums[1])),
    )  # fmt: skip


def _comparison(fn: str, pick: Pick, nums: list[int]) -> Bug:
    limit = nums[0]
    return Bug(
        f"def {fn}(value):\n    return value >= {limit}\n",
        f"    return value > {limit}", f"    return value >= {limit}", f"{fn}({limit})",
        f"`{fn}` is wrong exactly at its limit.", (), (str(limit),),
    )  # fmt: skip


def _wrong_variable(fn: str, pick: Pick, nums: list[int]) -> Bug:
    args = ", ".join(map(str, nums[:3]))
    return Bug(
        f"def {fn}(values):\n    smallest = min(values)\n    largest = max(values)\n    return largest\n",
        "    return smallest", "    return largest", f"{fn}([{args}])",
        f"`{fn}` returns the wrong one of the extremes it computes.", (), tuple(map(str, nums[:3])),
    )  # fmt: skip


def _misspelt(fn: str, pick: Pick, nums: list[int]) -> Bug:
    const, word = pick("noun").upper() + "_LABEL", pick("label").capitalize()
    at = next(i for i in range(1, len(word) - 1) if word[i] != word[i + 1])
    typo = word[:at] + word[at + 1] + word[at] + word[at + 2 :]
    return Bug(
        f'{const} = "{word}"\n\n\ndef {fn}(count):\n    return {const} + ": " + str(count)\n',
        f'{const} = "{typo}"', f'{const} = "{word}"', f"{fn}({nums[0]})",
        f"The label `{fn}` writes is misspelt.", (const,), (word, typo, str(nums[0])),
    )  # fmt: skip


def _wrong_index(fn: str, pick: Pick, nums: list[int]) -> Bug:
    args = ", ".join(map(str, nums[:3]))
    return Bug(
        f"def {fn}(items):\n    return items[-1]\n",
        "    return items[0]", "    return items[-1]", f"{fn}([{args}])",
        f"`{fn}` returns the wrong end of its list.", (), tuple(map(str, nums[:3])),
    )  # fmt: skip


def _boolean(fn: str, pick: Pick, nums: list[int]) -> Bug:
    low, high, probe = sorted(nums[:3])
    return Bug(
        f"def {fn}(value):\n    return value > {low} and value < {high}\n",
        f"    return value > {low} or value < {high}", f"    return value > {low} and value < {high}",
        f"{fn}({probe})", f"`{fn}` accepts values outside its range.", (), (str(low), str(high), str(probe)),
    )  # fmt: skip


KINDS: dict[str, Callable[[str, Pick, list[int]], Bug]] = {
    "constant": _constant,
    "operator": _operator,
    "off_by_one": _off_by_one,
    "swapped_args": _swapped_args,
    "wrong_key": _wrong_key,
    "comparison": _comparison,
    "wrong_variable": _wrong_variable,
    "misspelt": _misspelt,
    "wrong_index": _wrong_index,
    "boolean": _boolean,
}


@dataclasses.dataclass(frozen=True)
class SedEdit:
    """``sed -i 's/OLD/NEW/' PATH``: OLD occurs once in the file, so sed and ``apply`` change the same text."""

    path: str
    old: str
    new: str

    def command(self) -> str:
        def pattern(text: str) -> str:  # a basic regular expression matching ``text`` literally
            return re.sub(r"([\\.*\[^$/])", r"\\\1", text)

        def replacement(text: str) -> str:
            return re.sub(r"([\\&/])", r"\\\1", text)

        return f"sed -i 's/{pattern(self.old)}/{replacement(self.new)}/' {self.path}"

    def apply(self, text: str) -> str:
        if text.count(self.old) != 1:
            raise TaskError(f"{self.path}: {self.old!r} occurs {text.count(self.old)} times, expected once")
        return text.replace(self.old, self.new)


def one_line_edit(path: str, text: str, bugged: str, fixed: str) -> SedEdit:
    """The words of ``bugged`` (a line of ``text``) that changed on the way to ``fixed``, widened one word at a time
    until they start and end on a word (not bare punctuation) and occur once in ``text``, and what they become."""
    old, new = bugged.strip().split(" "), fixed.strip().split(" ")
    start = 0
    while start < min(len(old), len(new)) and old[start] == new[start]:
        start += 1
    end = 0  # common words at the end
    while end < min(len(old), len(new)) - start and old[-1 - end] == new[-1 - end]:
        end += 1
    lo, hi_old, hi_new = start, len(old) - end, len(new) - end  # old[lo:hi_old] became new[lo:hi_new]

    def fragment() -> str:
        return " ".join(old[lo:hi_old])

    def wordy(word: str) -> bool:
        return bool(re.search(r"\w", word))

    while lo > 0 or hi_old < len(old):
        if not fragment() or not wordy(old[lo]):
            left = lo > 0
        elif not wordy(old[hi_old - 1]):
            left = hi_old == len(old)
        elif text.count(fragment()) != 1:
            left = lo > 0
        else:
            break
        if left:
            lo -= 1
        else:
            hi_old, hi_new = hi_old + 1, hi_new + 1
    old_text, new_text = fragment(), " ".join(new[lo:hi_new])
    edit = SedEdit(path, old_text, new_text)
    if text.count(old_text) != 1 or edit.apply(text) != text.replace(bugged, fixed):
        raise TaskError(f"{path}: no one-line sed turns {bugged!r} into {fixed!r}")
    return edit


def _diff(path: str, before: str, after: str) -> str:
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=3
    )
    return f"diff --git a/{path} b/{path}\n" + "".join(lines)


def _evaluate(core: str, call: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(core, "core.py", "exec"), namespace)
    return eval(call, namespace)


@cache
def _modules(seed: int, split: str) -> tuple[str, ...]:
    """The split's module names in generation order: every adjective x noun pair, shuffled by the seed."""
    words = WORDS[split]
    pairs = [f"{a}_{n}" for a in words["adjective"] for n in words["noun"]]
    random.Random(f"{seed}:{split}:modules").shuffle(pairs)
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Made:
    """One generated task: its instance, the files of its base commit, its bug's fix as the teacher's sed."""

    instance: dict[str, Any]
    files: dict[str, str]
    edit: SedEdit
    words: dict[str, frozenset[str]]


@cache
def make(seed: int, split: str, index: int) -> Made:
    """Instance ``index`` of ``split`` (pure: the same arguments always give the same files and hashes)."""
    modules = _modules(seed, split)
    if not 0 <= index < len(modules):
        raise TaskError(f"{split} split of seed {seed}: index {index} outside 0..{len(modules) - 1}")
    module = modules[index]
    rng = random.Random(f"{seed}:{split}:{index}")
    words = WORDS[split]

    def pick(kind: str) -> str:
        return rng.choice(words[kind])

    nums = rng.sample(VALUES[split], 4)
    kind = list(KINDS)[index % len(KINDS)]
    fn = f"{pick('verb')}_{pick('noun')}"
    decoy = f"{pick('verb')}_{pick('noun')}"
    while decoy == fn:
        decoy = f"{pick('verb')}_{pick('noun')}"
    bug = KINDS[kind](fn, pick, nums)
    path, test_path = f"{module}/core.py", f"tests/test_{module}.py"
    title = module.replace("_", " ").capitalize()
    fixed = f'"""{title}."""\n\n\n{bug.source}\n\ndef {decoy}(x):\n    return x + {nums[3]}\n'
    if fixed.count(bug.fixed) != 1:
        raise TaskError(f"{module}: the {kind} template's line {bug.fixed!r} is not once in its file")
    core = fixed.replace(bug.fixed, bug.bugged)
    expected, actual = _evaluate(fixed, bug.call), _evaluate(core, bug.call)
    if expected == actual:
        raise TaskError(f"{module}: {bug.call} is {expected!r} with and without the {kind} bug")
    test_head = f"from {module} import {decoy}, {fn}\n\n\ndef test_{decoy}():\n    assert {decoy}(1) == {1 + nums[3]}\n"
    test_full = test_head + f"\n\ndef test_{fn}():\n    assert {bug.call} == {expected!r}\n"
    files = {
        "README.md": f"# {module}\n\nA small package. Run the tests with `python -m pytest`.\n",
        f"{module}/__init__.py": f"from {module}.core import {decoy}, {fn}\n\n__all__ = [{decoy!r}, {fn!r}]\n",
        path: core,
        test_path: test_head,
    }
    edit = one_line_edit(path, core, bug.bugged, bug.fixed)
    message = f"{module}: generated task base"
    commit = base_commit(files, message)
    test_patch = _diff(test_path, test_head, test_full)
    position = (index + index // len(KINDS)) % len(STYLES)  # not index % 8: it would tie styles to kinds' parity
    where = "" if position in UNNAMED else f" The code is in `{path}`."
    style = STYLES[position]
    if style == "diagnosed":
        body = f"`{bug.call}` returns `{actual!r}`. In `{path}`, `{edit.old}` should be `{edit.new}`."
    elif style == "values":
        body = f"`{bug.call}` returns `{actual!r}`; I expected `{expected!r}`.{where}"
    else:
        body = bug.symptom + where
    instance = {
        "instance_id": f"{OWNER}__{module}-{seed}",
        "repo": f"{OWNER}/{module}",
        "base_commit": commit,
        "patch": _diff(path, core, fixed),
        "test_patch": test_patch,
        "problem_statement": f"{fn}() gives a wrong result\n\n{body}\n",
        "hints_text": "",
        "created_at": "2024-01-01T00:00:00Z",
        "version": "0.1",
        "FAIL_TO_PASS": [f"{test_path}::test_{fn}"],
        "PASS_TO_PASS": [f"{test_path}::test_{decoy}"],
        "environment_setup_commit": commit,
        # Content-named: `python -m eval images build` makes it (eval/sessions/images.py); the local runner needs none.
        "image": image_tag(f"{OWNER}/{module}", commit),
        "log_parser": "parse_log_pytest",
        "eval_type": EvalType.PASS_AND_FAIL.value,
        "eval_script": eval_script(commit, test_patch),
        "split": split,
        "bug_kind": kind,
        "issue_style": style,
        "names_file": position not in UNNAMED,
    }
    chosen = {
        "modules": frozenset({module}),
        "identifiers": frozenset({fn, decoy, *bug.identifiers}),
        "values": frozenset({*bug.values, str(nums[3])}),
    }
    return Made(instance, files, edit, chosen)


def generate(seed: int = 0, sizes: dict[str, int] | None = None) -> dict[str, list[dict[str, Any]]]:
    """The family of ``seed``: ``sizes`` (default ``SIZES``) instances per split, checked disjoint."""
    sizes = sizes or SIZES
    made = {split: [make(seed, split, i) for i in range(sizes.get(split, 0))] for split in SPLITS}
    check_disjoint({split: [m.words for m in made[split]] for split in SPLITS})
    return {split: [m.instance for m in made[split]] for split in SPLITS}


def _parse_id(instance_id: str) -> tuple[str, int]:
    match = re.fullmatch(rf"{OWNER}__([a-z_]+)-(\d+)", instance_id)
    if not match:
        raise TaskError(f"instance {instance_id!r}: not a generated task id ({OWNER}__<module>-<seed>)")
    return match.group(1), int(match.group(2))


def _made(instance_id: str) -> Made:
    module, seed = _parse_id(instance_id)
    for split in SPLITS:
        if module in _modules(seed, split):
            return make(seed, split, _modules(seed, split).index(module))
    raise TaskError(f"instance {instance_id!r}: module {module!r} is in neither split's word lists")


def instance_split(instance_id: str) -> str:
    """ "train" or "heldout": which split a generated task id belongs to."""
    return str(_made(instance_id).instance["split"])


def repo_files(instance_id: str) -> dict[str, str]:
    """The files of a generated task's base commit, made again from its id."""
    return dict(_made(instance_id).files)


def words_of(instance_id: str) -> dict[str, frozenset[str]]:
    """The module, identifiers and values a generated task chose."""
    return dict(_made(instance_id).words)


def sed_edit(instance: dict[str, Any]) -> SedEdit:
    """The teacher's sed, derived from the instance's gold patch: its one changed line, as ``one_line_edit``
    cuts it from the file of the task's base commit."""
    (changed,) = PatchSet(instance["patch"])
    (hunk,) = changed
    removed = [line.value.rstrip("\n") for line in hunk if line.is_removed]
    added = [line.value.rstrip("\n") for line in hunk if line.is_added]
    if len(removed) != 1 or len(added) != 1:
        raise TaskError(f"instance {instance['instance_id']!r}: the gold patch is not a one-line change")
    text = repo_files(instance["instance_id"])[changed.path]
    return one_line_edit(changed.path, text, removed[0], added[0])


def teacher_messages(instance: dict[str, Any]) -> list[dict[str, Any]]:
    """The worked session (eval/upstream/script.py's message list): the sed, then a one-line answer."""
    edit = sed_edit(instance)
    return [
        {"content": None, "tool_calls": [{"name": "bash", "arguments": {"command": edit.command()}}]},
        {"content": f"Fixed {edit.path}: {edit.old} is now {edit.new}.", "tool_calls": []},
    ]


def check_disjoint(words: dict[str, list[dict[str, frozenset[str]]]]) -> None:
    """TaskError naming what the splits share, if a module, identifier or value chosen by an instance of one
    split (``words``: split -> each instance's ``Made.words``) is chosen by one of the other."""
    chosen = {
        split: {
            key: set().union(*(w[key] for w in words.get(split, []))) for key in ("modules", "identifiers", "values")
        }
        for split in SPLITS
    }
    shared = {key: sorted(chosen["train"][key] & chosen["heldout"][key]) for key in chosen["train"]}
    if any(shared.values()):
        raise TaskError(f"the train and held-out splits share {', '.join(f'{k} {v}' for k, v in shared.items() if v)}")
