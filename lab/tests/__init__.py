"""The lab's tests (a package, so that its conftest and helpers never shadow the package's tests' in one session)."""
