"""The ``polytrain`` command line: parses flags and calls the library."""
