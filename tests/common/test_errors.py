from __future__ import annotations

from tritonshare.common import errors


def test_every_error_class_maps_to_its_documented_exit_code() -> None:
    expected = {
        errors.UsageError: 2,
        errors.SourceNotFound: 10,
        errors.SourceAccessDenied: 10,
        errors.InvalidModel: 10,
        errors.UnsafeArchive: 10,
        errors.TransientSourceError: 11,
        errors.TritonLoadFailed: 12,
        errors.ReadinessTimeout: 13,
        errors.InstallConflict: 14,
        errors.InsufficientSpace: 15,
    }
    for cls, code in expected.items():
        assert cls("x").exit_code == code, cls
        assert issubclass(cls, errors.TritonshareError)
    # the docstring's drawing of the tree names every class
    assert all(cls.__name__ in (errors.__doc__ or "") for cls in expected)


def test_clip_keeps_messages_short_and_on_one_line() -> None:
    assert errors.clip("a\n  b") == "a b"
    long = errors.clip("x" * 1000, 50)
    assert len(long) == 50 and long.endswith("…")
