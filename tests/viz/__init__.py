"""Tests of pdcompile.viz: tables, pictures, Gantt charts, predicted against measured."""
