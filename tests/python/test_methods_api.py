"""gradsparse.methods.core_method's arguments: a bad one is refused naming it, its value and the
fix (the options themselves are the states': tests/python/test_state.py, test_config.py)."""

import pytest

from gradsparse.methods import core_method


@pytest.mark.parametrize(
    "args,error,message",
    [
        # a list was looked up in the methods' dicts: "unhashable type: 'list'"
        ((["topk"],), TypeError, "core_method: name must be a method's name (a str), got ['topk'] (list); choose from"),
        # an int was iterated: "'int' object is not iterable"
        (("topk", 1000), TypeError, "core_method: numels must be a list of the bucket's parameters' element counts"),
        # pybind11's list of the C++ constructor's signatures
        (("sage", [1.5]), TypeError, "core_method: numels[0] must be an integer >= 0, got 1.5 (float); for example"),
        # True counted as a parameter of 1 element
        (("sage", [10, True]), TypeError, "core_method: numels[1] must be an integer >= 0, got True (bool)"),
        (("topk", [-1]), ValueError, "core_method: numels[0] must be >= 0, got -1; for example numels=[1000]"),
        # past int64_t: pybind11's list of the C++ constructor's signatures
        (("sage", [5, 2**63]), ValueError, "core_method: numels[1] must be at most 9223372036854775807, got 92233"),
    ],
)
def test_core_method_refuses_bad_arguments_naming_them(args, error, message):
    with pytest.raises(error) as info:
        core_method(*args, density=0.01)
    assert message in str(info.value)


def test_core_method_takes_the_element_counts_as_a_list_or_a_tuple():
    assert core_method("sage", (4, 6), density=0.1, sampling="per_tensor").exchange == "gather-and-add"
    assert core_method("TopK", [10], density=0.1).exchange == "fixed-size gather"


def test_every_method_is_exported_wherever_a_method_is_listed():
    """Adding a method touches four Python lists (docs/adding-a-method.md): METHODS, the
    methods module's __all__ and the package's imports and __all__. One left out made the method
    unreachable by name (the examples' --method), by gradsparse.<Class> or by a star import, and
    a C++ method class without a State was never reachable from Python at all."""
    import inspect

    import gradsparse
    from gradsparse import _C, methods
    from gradsparse.state import State

    defined = {
        name
        for name, obj in vars(methods).items()
        if inspect.isclass(obj) and issubclass(obj, State) and obj.__module__ == methods.__name__
    } - {name for name in vars(methods) if name.startswith("_")}  # private bases (_Partitioned)
    listed = {cls.__name__ for cls in methods.METHODS.values()}
    assert defined == listed, f"State classes of gradsparse.methods not in METHODS (or the reverse): {defined ^ listed}"
    for cls in methods.METHODS.values():
        assert cls.__name__ in methods.__all__, f"{cls.__name__} missing from gradsparse.methods.__all__"
        assert cls.__name__ in gradsparse.__all__, f"{cls.__name__} missing from gradsparse.__all__"
        assert getattr(gradsparse, cls.__name__) is cls, f"gradsparse.{cls.__name__} is not the method class"
    for module in (gradsparse, methods):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"{module.__name__}.__all__ names what the module does not hold: {missing}"
    cores = {cls._CORE for cls in methods.METHODS.values()} - {None}
    bound = {name for name, obj in vars(_C).items() if inspect.isclass(obj) and issubclass(obj, _C.Method)}
    bound -= {"Method", "PerRankMethod"}  # the bases
    assert cores == bound, f"C++ method classes without a State (or States naming no C++ class): {cores ^ bound}"
