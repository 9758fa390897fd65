"""zeroplan's tests, in folders that mirror the package (tests/README.md)."""
