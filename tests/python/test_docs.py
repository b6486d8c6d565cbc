"""The user-facing lists of methods cover exactly the methods that exist: README's table,
docs/methods.md (its table and one section each, with the constructor's real defaults),
docs/method-spec.md, docs/architecture.md's classes, examples/README.md and the examples'
--method choices. A method added, renamed or given a new
default without its documentation fails here. The exchanges have one glossary: the names the
library gives them (gradsparse._C.exchanges()) are those of docs/architecture.md's table and of
README's method table, whose rows name the exchange each method really uses. The command lines
that the docs show for the examples, the benchmarks and gradsparse.simulate use only options (and
presets and methods) that exist."""

import inspect
import re
from pathlib import Path

import pytest

import gradsparse as gs
from gradsparse.methods import core_method

ROOT = Path(__file__).resolve().parents[2]
SPARSE = {name: cls for name, cls in gs.METHODS.items() if name != "dense"}
CLASSES = {cls.__name__ for cls in gs.METHODS.values()}


def read(relative: str) -> str:
    path = ROOT / relative
    if not path.exists():
        pytest.fail(f"{relative} is missing from the checkout at {ROOT}")
    return path.read_text()


def table_rows(text: str, header: str) -> list[str]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"no table starting with {header!r}"
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def check_defaults(where: str, class_name: str, arguments: str) -> None:
    """Every ``name=value`` in a documented call is an option of the class with that default."""
    signature = inspect.signature(getattr(gs, class_name)).parameters
    for name, default in re.findall(r"(\w+)=([^,]+)", arguments):
        assert name in signature, f"{where}: {class_name} has no option {name!r}"
        actual = signature[name].default
        assert default.strip() == repr(actual).replace("'", '"'), (
            f"{where} gives {class_name}'s {name} the default {default}, the code {actual!r}"
        )


def test_readme_table_lists_every_method_once_with_the_real_defaults():
    rows = table_rows(read("README.md"), "| method | class |")
    calls = [m.groups() for row in rows if (m := re.search(r"`gs\.(\w+)\((.*?)\)`", row))]
    assert sorted(name for name, _ in calls) == sorted(CLASSES), "README's method table and gradsparse.METHODS differ"
    for name, arguments in calls:
        check_defaults("README.md", name, arguments)


def test_methods_doc_table_lists_every_sparse_method_once():
    rows = table_rows(read("docs/methods.md"), "| method | selection cost")
    named = [m.group(1) for row in rows if (m := re.match(r"\| `(\w+)` \|", row))]
    assert sorted(named) == sorted(cls.__name__ for cls in SPARSE.values())


def header_signatures(text: str, pattern: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(pattern, text, flags=re.MULTILINE)}


def test_methods_doc_has_a_section_per_method_with_the_real_defaults():
    sections = header_signatures(read("docs/methods.md"), r"^### .*?`gs\.(\w+)\((.*?)\)`")
    assert set(sections) == {cls.__name__ for cls in SPARSE.values()}
    for name, arguments in sections.items():
        check_defaults("docs/methods.md", name, arguments)


def test_method_spec_has_a_section_per_method():
    sections = header_signatures(read("docs/method-spec.md"), r"^### 4\.\d+ .*? — `(\w+)\((.*?)\)`")
    assert set(sections) == {cls.__name__ for cls in SPARSE.values()}


def test_examples_offer_exactly_the_methods_and_torch_hooks():
    from examples import driver

    assert set(driver.METHODS) == set(gs.METHODS) | set(driver.TORCH_HOOKS)
    assert len(driver.METHODS) == len(set(driver.METHODS))


def test_architecture_and_examples_readme_name_every_method():
    classes = re.search(r"one class per method \(([^)]*)\)", read("docs/architecture.md")).group(1)
    assert sorted(re.findall(r"`(\w+)`", classes)) == sorted(cls.__name__ for cls in SPARSE.values())
    listed = re.search(r"every gradsparse method: (.*?)\.\n", read("examples/README.md"), flags=re.DOTALL).group(1)
    assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(SPARSE)


def test_architecture_exchange_table_is_the_glossary():
    rows = table_rows(read("docs/architecture.md"), "| exchange | used by |")
    named = [row.split("|")[1].strip() for row in rows]
    assert named == gs._C.exchanges(), "docs/architecture.md's exchange table and the library's exchanges differ"


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_readme_names_the_exchange_each_method_uses(name):
    cls = SPARSE[name]
    row = next(row for row in table_rows(read("README.md"), "| method | class |") if f"`gs.{cls.__name__}(" in row)
    default, under_fsdp = (cell.strip() for cell in row.split("|")[3:5])
    method = core_method(name, **({"threshold": 1.0} if name == "threshold" else {"density": 0.1}))
    assert default.split(" (")[0] == method.exchange, (
        f"README: {cls.__name__} uses {default!r}, the code {method.exchange!r}"
    )
    assert under_fsdp.startswith(("sparse reduce-scatter", "whole exchange")), f"README: {cls.__name__}: {under_fsdp!r}"


EXAMPLE_DOCS = ["README.md", "examples/README.md", "slurm/README.md", "docs/methods.md"]
EXAMPLE_COMMAND = re.compile(
    r"(?:-m examples\.(cnn|lstm|ncf|gpt)|(?:(?:TASK=(cnn|lstm|ncf))[^`\n]*?)?sbatch[^`\n]*?slurm/\S+\.sbatch)\b(.*)"
)


def example_parser(task: str):
    import argparse
    import importlib

    from examples import driver

    module = importlib.import_module(f"examples.{task}.__main__")
    parser = argparse.ArgumentParser()
    driver.add_arguments(parser)
    module.add_task_arguments(parser.add_argument_group("task"))
    return parser, module.PRESETS


def example_commands() -> list[tuple[str, str, list[str]]]:
    """(where, task, arguments) of every example command line in the docs: the lines of their code
    blocks and their inline `...` commands (which may wrap), `python -m examples.T ...`,
    `torchrun ... -m examples.T ...` and `[TASK=T] sbatch ... slurm/X.sbatch ...` (cnn unless TASK says)."""
    found = []
    for relative in EXAMPLE_DOCS:
        text = read(relative)
        fence = r"^[ \t]*```\w*\n(.*?)^[ \t]*```"
        blocks = re.findall(fence, text, flags=re.MULTILINE | re.DOTALL)
        pieces = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        outside = re.sub(fence, "", text, flags=re.MULTILINE | re.DOTALL)
        pieces += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", outside)]
        for piece in pieces:
            m = EXAMPLE_COMMAND.search(piece.split(" #")[0])
            if m and "examples.$TASK" not in piece:
                task = m.group(1) or m.group(2) or "cnn"
                found.append((f"{relative}: {piece.strip()}", task, m.group(3).split()))
    return found


def test_example_commands_in_the_docs_use_real_flags_presets_and_methods(monkeypatch):
    from examples import driver

    commands = example_commands()
    assert len(commands) > 15 and {task for _, task, _ in commands} == {"cnn", "lstm", "ncf", "gpt"}, commands
    parsers = {task: example_parser(task) for task in ("cnn", "lstm", "ncf")}
    parsers["gpt"] = module_parser("examples.gpt.__main__", monkeypatch), {}  # the Trainer's, outside the driver
    for where, task, arguments in commands:
        parser, presets = parsers[task]
        for i, token in enumerate(arguments):
            if not token.startswith("--") or token == "--":
                continue
            flag, _, value = token.partition("=")
            assert flag in parser._option_string_actions, f"{where}: examples.{task} has no option {flag}"
            value = value or (arguments[i + 1] if i + 1 < len(arguments) else "")
            if flag == "--preset":
                assert value in presets, f"{where}: examples.{task} has no preset {value!r}: {sorted(presets)}"
            if flag == "--method":
                methods = gs.METHODS if task == "gpt" else driver.METHODS  # the Trainer's has no torch hooks
                unknown = [name for name in value.split(",") if name not in methods]
                assert not unknown, f"{where}: examples.{task} has no method {unknown}"


def test_examples_readme_options_exist_in_every_task():
    text = read("examples/README.md")
    options = text[text.index("## Options (every task)") : text.index("## What a run writes")]
    flags = set(re.findall(r"`(--[a-z][a-z0-9-]*)", options))
    assert len(flags) > 30, flags
    for task in ("cnn", "lstm", "ncf"):
        parser, _ = example_parser(task)
        missing = sorted(flag for flag in flags if flag not in parser._option_string_actions)
        assert not missing, f"examples/README.md names options that examples.{task} lacks: {missing}"


def test_examples_readme_lists_every_method_flag():
    """The README's list of the flags that methods declare is driver.method_flags(), exactly: a
    method with a new option (docs/adding-a-method.md, step 7) is listed there."""
    from examples import driver

    text = read("examples/README.md")
    listed = text[text.index("one flag per option that a method declares") :]
    listed = listed[: listed.index("`--help` says which methods take each")]
    flags = re.findall(r"`--([a-z][a-z0-9-]*)`", listed)
    assert sorted(flags) == sorted(name.replace("_", "-") for name in driver.method_flags()), flags


class _Parsed(Exception):
    pass


def module_parser(module_name: str, monkeypatch):
    """The argparse parser that ``python -m module_name`` builds in its main(), caught as it parses."""
    import argparse
    import importlib

    def catch(parser, args=None, namespace=None):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    module = importlib.import_module(module_name)
    with pytest.raises(_Parsed) as caught:
        module.main([])
    monkeypatch.undo()
    return caught.value.args[0]


def test_benchmark_and_simulate_commands_in_the_docs_use_real_flags(monkeypatch):
    command = re.compile(r"python -m ((?:benchmarks|gradsparse)\.\w+)((?:\s+(?:--?[\w-]+(?:=\S+)?|[\w.,:/]+))*)")
    found = []
    for relative in [*EXAMPLE_DOCS, "docs/benchmarks.md"]:
        for m in command.finditer(read(relative)):
            arguments = m.group(2).split(" -- ")[0].split()  # after --: the examples' own
            found.append((relative, m.group(1), [a.partition("=")[0] for a in arguments if a.startswith("--")]))
    assert {name for _, name, _ in found} >= {"benchmarks.select", "benchmarks.cluster", "gradsparse.simulate"}
    parsers = {}
    for where, name, flags in found:
        if name not in parsers:
            parsers[name] = module_parser(name, monkeypatch)
        unknown = [flag for flag in flags if flag != "--" and flag not in parsers[name]._option_string_actions]
        assert not unknown, f"{where}: python -m {name} has no option {unknown}"
