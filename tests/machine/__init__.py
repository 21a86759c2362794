"""Tests of pdcompile.machine: the cluster and device model, the local machine measured."""
