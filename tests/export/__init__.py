"""Tests of pdcompile.export: the files of an export, load, round trips."""
