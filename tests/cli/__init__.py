"""Tests of pdcompile.cli: one file per subcommand and the command line's conventions."""
