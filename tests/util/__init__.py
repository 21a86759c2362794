"""Tests of pdcompile.util: a user's files read bounded, and the messages that refuse them."""
