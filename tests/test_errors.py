"""``lightspeed.errors``: every exception lightspeed raises on purpose, under one base class, each still the built-in
exception it was; the CLI reports any of them as a user error (exit 2, one line, no traceback)."""

from __future__ import annotations

import inspect

import pytest

import lightspeed
from lightspeed import errors
from lightspeed.cli import main as cli_main
from lightspeed.core import errors as core_errors

BUILT_IN = {
    "AdapterTargetError": ValueError,
    "SequenceParallelError": ValueError,
    "CheckpointError": ValueError,
    "ExportError": ValueError,
    "DeepSpeedConfigError": ValueError,
    "MemoryPlanError": ValueError,
    "WorldSizeMismatchError": ValueError,
    "UnsupportedOffloadOptimizerError": TypeError,
    "IncompleteCheckpointError": RuntimeError,  # and ValueError, as a CheckpointError
    "CollectiveTimeoutError": RuntimeError,
    "HostAddressError": RuntimeError,
    "RankLostError": RuntimeError,
    "UnevenEvaluationError": RuntimeError,
    "ModelChangedError": RuntimeError,
    "EngineReleasedError": RuntimeError,
    "CudaInitializedError": RuntimeError,
    "GatherError": RuntimeError,
    "CallSiteMismatchError": RuntimeError,
    "StepOutputError": RuntimeError,
}


def test_every_exception_class_of_the_package_is_public_under_one_base() -> None:
    defined = {
        name
        for name, value in vars(core_errors).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == core_errors.__name__
    }
    assert defined == set(errors.__all__) == set(BUILT_IN) | {"LightspeedError"}
    for name, built_in in BUILT_IN.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.LightspeedError) and issubclass(cls, built_in), name
    assert issubclass(errors.RankLostError, errors.CollectiveTimeoutError)  # one `except` for both ways a job stalls
    assert lightspeed.errors is errors


def test_an_incomplete_checkpoint_is_a_checkpoint_error_and_still_a_runtime_error() -> None:
    assert issubclass(errors.IncompleteCheckpointError, errors.CheckpointError)  # one `except` for every bad checkpoint
    assert issubclass(errors.IncompleteCheckpointError, RuntimeError)  # the `except RuntimeError` written before
    with pytest.raises(errors.CheckpointError, match="interrupted"):
        raise errors.IncompleteCheckpointError("interrupted")


def test_the_old_name_of_a_renamed_class_is_the_same_class_with_a_warning() -> None:
    from lightspeed.core.errors import DEPRECATED_NAMES

    assert DEPRECATED_NAMES == {"CallSiteMismatch": "CallSiteMismatchError"}
    assert "CallSiteMismatch" not in errors.__all__ and "CallSiteMismatchError" in errors.__all__
    for module in (errors, core_errors):
        with pytest.warns(
            FutureWarning,
            match=r"lightspeed\.errors\.CallSiteMismatch is deprecated .* use "
            r"lightspeed\.errors\.CallSiteMismatchError instead",
        ) as caught:
            assert module.CallSiteMismatch is errors.CallSiteMismatchError
        assert caught[0].filename == __file__  # the warning names the line that used the old name
    with pytest.warns(FutureWarning, match="CallSiteMismatchError"):
        from lightspeed.errors import CallSiteMismatch
    with pytest.warns(FutureWarning):
        try:  # an `except` clause written with the old name still catches the error
            raise errors.CallSiteMismatchError("ranks in different calls")
        except errors.CallSiteMismatch as caught_error:
            assert isinstance(caught_error, CallSiteMismatch)
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchError'"):
        errors.NoSuchError  # noqa: B018


def test_the_classes_users_meet_are_the_public_ones() -> None:
    from lightspeed.core.errors import GatherError, IncompleteCheckpointError, WorldSizeMismatchError

    assert (GatherError, IncompleteCheckpointError, WorldSizeMismatchError) == (
        errors.GatherError,
        errors.IncompleteCheckpointError,
        errors.WorldSizeMismatchError,
    )
    with pytest.raises(errors.LightspeedError, match="has no unit"):
        from lightspeed.core.zero.auto_choice import ZeroAutoRequest

        ZeroAutoRequest.from_arguments(
            safety_margin=0.1,
            device_memory="16",
            host_memory=None,
            nvme_path=None,
            optimizer_state_bytes=8,
            config=None,
            kwargs={},
        )


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_the_cli_reports_every_lightspeed_error_as_a_user_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    def failing_run(args: object) -> int:
        raise getattr(errors, name)("what to change")

    parser = cli_main.build_parser()
    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["env"].set_defaults(_run=failing_run)  # type: ignore[union-attr]
    assert cli_main.main(["env"]) == 2
    assert capsys.readouterr().err == "lightspeed env: error: what to change\n"


#: where the error classes are defined and the one public module that hands them to users; elsewhere in the package
#: they are imported from core only, and no other ``__all__`` lists them
PUBLIC_REEXPORTS = {"core/errors.py", "errors.py"}


def test_the_package_imports_its_errors_from_core_errors_only() -> None:
    import ast
    from pathlib import Path

    package = Path(lightspeed.__file__).parent
    names = set(BUILT_IN) | {"LightspeedError"}
    elsewhere = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module != "lightspeed.core.errors":
                elsewhere += [f"{relative}:{node.lineno} {a.name}" for a in node.names if a.name in names]
            if relative in PUBLIC_REEXPORTS or not isinstance(node, ast.Assign):
                continue
            if any(isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets):
                elsewhere += [f"{relative} __all__ {e.value}" for e in node.value.elts if e.value in names]
    assert elsewhere == []
