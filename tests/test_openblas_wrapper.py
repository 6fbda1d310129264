"""tests/openblas.py's `under_openblas` (a module's tests run in a pytest process of their own)
reports what the inner run did: it passes only where inner tests ran and passed, skips with the
inner skip reasons where every one was skipped (it passed, for tests that never ran: the real
model missing), fails where one failed or none was collected. Tiny inner modules in tmp_path;
the preload itself is left out (what it runs does not need a BLAS)."""

from __future__ import annotations

import textwrap

import pytest

from tests import openblas

WRAPPER = """
from tests import openblas

def test_this_module_under_openblas():
    openblas.under_openblas(__file__)
"""


@pytest.fixture
def inner(tmp_path, monkeypatch):
    """A function writing an inner module (with the wrapper test inner modules have) and
    running `under_openblas` on it from a process that does not hold OpenBLAS."""
    monkeypatch.setattr(openblas, "library", lambda: "/no/such/libopenblas.so.0")
    # the inner process: no preload, and its wrapper skips itself (as in a process that has
    # OpenBLAS) because POSTTRAINLLM_NO_BLAS_PRELOAD leaves it no library to preload
    monkeypatch.setattr(openblas.blas, "preload_environ", lambda env, lib: {
        **env, "PYTHONPATH": str(openblas.ROOT), "POSTTRAINLLM_NO_BLAS_PRELOAD": "1"})

    def run(body: str, wrapper: bool = True):
        path = tmp_path / "test_inner.py"
        path.write_text(textwrap.dedent(body) + (WRAPPER if wrapper else ""))
        return openblas.under_openblas(str(path), timeout=120)
    return run


def test_every_inner_test_skipped_skips_with_their_reasons(inner):
    with pytest.raises(pytest.skip.Exception) as e:
        inner("""
            import pytest

            def test_a():
                pytest.skip("the real model is not here")

            def test_b():
                pytest.skip("the real model is not here")
            """)
    assert "ran none of its 2 tests: the real model is not here" in str(e.value), str(e.value)


def test_inner_tests_that_pass_pass(inner):
    inner("""
        def test_a():
            assert 1 + 1 == 2
        """)


def test_one_ran_one_skipped_passes(inner):
    inner("""
        import pytest

        def test_a():
            assert True

        def test_b():
            pytest.skip("not here")
        """)


def test_an_inner_failure_fails(inner):
    with pytest.raises(AssertionError, match="failed"):
        inner("""
            def test_a():
                assert 1 + 1 == 3
            """)


def test_nothing_collected_fails(inner):
    with pytest.raises(AssertionError, match="collected no tests"):
        inner("x = 1\n", wrapper=False)


def test_only_the_wrapper_collected_fails(inner):
    with pytest.raises(AssertionError, match="collected no tests but its wrapper"):
        inner("")
