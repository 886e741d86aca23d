"""What the tests share: small fleets and how to bill them, builders of pipeline tables, and
the hours they are set in. Imported as `tests.helpers.<module>`; fixtures are in
tests/conftest.py."""
